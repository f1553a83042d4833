//! `moe-operator`: `run` the controller, print the `crd`, `plan` a deployment offline, or
//! `validate` manifests.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use kube::runtime::events::Reporter;
use kube::Client;
use moe_operator::controller::{builtin_scaler, run_controller, Context};
use moe_operator::leader::{self, LeaseConfig};
use moe_operator::metrics::Metrics;
use moe_operator::node_cache::NodeCache;
use moe_operator::pod_cache::PodCache;
use moe_operator::server::{router, Health, ServerState};
use moe_operator::{activator, crd, manifests, plan};
use tokio::sync::watch;

#[derive(Parser)]
#[command(
    name = "moe-operator",
    version,
    about = "Kubernetes operator for MoEDeployment resources"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the MoEDeployment CustomResourceDefinition as YAML.
    Crd,
    /// Offline dry run: placement decision with per-node reasons, then the objects to apply.
    Plan {
        /// File with one MoEDeployment.
        #[arg(long)]
        deployment: PathBuf,
        /// File with Node objects (a List or several YAML documents).
        #[arg(long)]
        nodes: PathBuf,
    },
    /// Validate Kubernetes manifests (YAML streams) against the k8s-openapi types and the spec rules.
    Validate {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Run the controller.
    Run(RunArgs),
    /// Run the scale-from-zero activator: hold requests while no replica is ready, then forward.
    Activator(ActivatorArgs),
}

#[derive(clap::Args)]
struct ActivatorArgs {
    /// Address the proxy listens on (also serves /metrics and /activator/healthz).
    #[arg(long, default_value = "0.0.0.0:8000")]
    listen: SocketAddr,
    /// Base URL of the replicas' Service, e.g. http://qwen-backend.ai.svc:8000.
    #[arg(long)]
    upstream: http::Uri,
    /// Seconds a request may wait for a replica before it gets 503 (cover the model load time).
    #[arg(long, default_value_t = 1800)]
    wait_timeout_seconds: u64,
    /// Requests held at once; more are refused with 503.
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
    /// Largest request body buffered while waiting, in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_body_bytes: usize,
    /// Milliseconds between upstream GET /ready probes.
    #[arg(long, default_value_t = 1000)]
    probe_interval_ms: u64,
}

async fn run_activator(args: ActivatorArgs) -> anyhow::Result<()> {
    if args.upstream.scheme_str() != Some("http") || args.upstream.authority().is_none() {
        bail!(
            "--upstream must be an http:// URL with a host, got {}",
            args.upstream
        );
    }
    let app = activator::activator(activator::ActivatorConfig {
        upstream: args.upstream,
        wait_timeout: std::time::Duration::from_secs(args.wait_timeout_seconds),
        max_waiting: args.max_waiting,
        max_body_bytes: args.max_body_bytes,
        probe_period: std::time::Duration::from_millis(args.probe_interval_ms.max(10)),
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(listen = %args.listen, "activator running");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("activator server")
}

#[derive(clap::Args)]
struct RunArgs {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(
        long,
        env = "MOE_OPERATOR_METRICS_ADDR",
        default_value = "0.0.0.0:8080"
    )]
    metrics_addr: SocketAddr,
    /// Namespaces to watch (comma separated); empty watches all.
    #[arg(
        long,
        env = "MOE_OPERATOR_WATCH_NAMESPACES",
        value_delimiter = ',',
        default_value = ""
    )]
    watch_namespaces: Vec<String>,
    /// Elect a leader through a Lease so that only one replica acts.
    #[arg(long, env = "MOE_OPERATOR_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    #[arg(
        long,
        env = "MOE_OPERATOR_LEASE_NAME",
        default_value = "moe-operator-leader"
    )]
    lease_name: String,
    /// Namespace of the Lease (the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Identity in the Lease and in Events (the pod name).
    #[arg(long, env = "POD_NAME", default_value = "moe-operator")]
    identity: String,
    /// `builtin` runs the queue-depth autoscaler; `none` (or `off`) leaves scaling to HPA/KEDA/humans.
    #[arg(long, env = "MOE_OPERATOR_AUTOSCALER", default_value = "builtin", value_parser = ["builtin", "none", "off"])]
    autoscaler: String,
}

fn read(path: &PathBuf) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Crd => print!("{}", crd::crd_yaml().context("rendering the CRD")?),
        Command::Plan { deployment, nodes } => {
            print!("{}", plan::plan(&read(&deployment)?, &read(&nodes)?)?);
        }
        Command::Validate { files } => {
            let mut failed = false;
            for file in &files {
                match manifests::validate_yaml_stream(&read(file)?, &file.display().to_string()) {
                    Ok(kinds) => println!("{}: {} object(s) valid", file.display(), kinds.len()),
                    Err(problems) => {
                        failed = true;
                        for p in problems {
                            eprintln!("{p}");
                        }
                    }
                }
            }
            if failed {
                bail!("invalid manifests");
            }
        }
        Command::Run(args) => run(args).await?,
        Command::Activator(args) => run_activator(args).await?,
    }
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let metrics = Metrics::new()?;
    let ready = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);

    // Health and metrics first, so probes answer while waiting for leadership.
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("binding {}", args.metrics_addr))?;
    let health = Arc::new(Health::default());
    let app = router(ServerState {
        metrics: metrics.clone(),
        ready: ready.clone(),
        health: health.clone(),
    });
    let mut server_stop = stop_rx.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = server_stop.changed().await;
            })
            .await
    });
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutdown requested");
        let _ = stop_tx.send(true);
    });

    client
        .apiserver_version()
        .await
        .context("the API server did not answer")?;
    ready.store(true, Ordering::Relaxed);

    let lease_cfg = LeaseConfig {
        name: args.lease_name.clone(),
        namespace: args.lease_namespace.clone(),
        identity: args.identity.clone(),
        lease_duration: std::time::Duration::from_secs(15),
        renew_period: std::time::Duration::from_secs(2),
        renew_deadline: std::time::Duration::from_secs(10),
    };
    let mut observed = leader::LeaseObservation::default();
    let leases: Api<Lease> = Api::namespaced(client.clone(), &args.lease_namespace);
    if args.leader_election {
        let mut stop = stop_rx.clone();
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            match leader::try_acquire_or_renew(&leases, &lease_cfg, &mut observed).await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election"),
            }
            tokio::select! {
                _ = tokio::time::sleep(lease_cfg.renew_period) => {}
                _ = stop.changed() => {}
            }
        }
        tracing::info!(identity = %args.identity, "acquired leadership");
    }
    metrics.is_leader.set(1);

    let reporter = Reporter {
        controller: "moe-operator".into(),
        instance: Some(args.identity.clone()),
    };
    // One Node watch for all controllers: reconciles read nodes from its cache.
    let node_cache = NodeCache::spawn(client.clone(), health.clone());
    // And one Pod watch (bound, running pods only): what is already requested on each node.
    let pod_cache = PodCache::spawn(client.clone(), health.clone());
    let ctx = Arc::new(
        Context::new(client.clone(), reporter, metrics.clone())
            .with_node_cache(node_cache)
            .with_pod_cache(pod_cache)
            .with_health(health.clone()),
    );
    let namespaces: Vec<String> = args
        .watch_namespaces
        .iter()
        .filter(|n| !n.is_empty())
        .cloned()
        .collect();

    // Keep renewing; losing the lease stops this replica so that it restarts as a standby.
    let (lost_tx, mut lost_rx) = watch::channel(false);
    if args.leader_election {
        let (leases, cfg, mut stop) = (leases.clone(), lease_cfg.clone(), stop_rx.clone());
        tokio::spawn(async move {
            // Measured from the start of the last successful renewal, on the local clock: past the
            // renew deadline (< lease duration) this replica stops before a standby may take over.
            let mut last_ok = std::time::Instant::now();
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(cfg.renew_period) => {}
                    _ = stop.changed() => return,
                }
                let started = std::time::Instant::now();
                let left = cfg.renew_deadline.saturating_sub(last_ok.elapsed());
                let attempt = tokio::time::timeout(
                    left,
                    leader::try_acquire_or_renew(&leases, &cfg, &mut observed),
                )
                .await;
                match attempt {
                    Ok(Ok(true)) => last_ok = started,
                    Ok(Ok(false)) => {
                        let _ = lost_tx.send(true);
                        return;
                    }
                    Ok(Err(e)) if last_ok.elapsed() < cfg.renew_deadline => {
                        tracing::warn!(error = %e, "lease renewal failed; retrying")
                    }
                    Ok(Err(e)) => {
                        tracing::error!(error = %e, "cannot renew the lease within the deadline");
                        let _ = lost_tx.send(true);
                        return;
                    }
                    Err(_) => {
                        tracing::error!("lease renewal did not finish within the deadline");
                        let _ = lost_tx.send(true);
                        return;
                    }
                }
            }
        });
    }
    let (halt_tx, _) = watch::channel(false);
    {
        let (halt_tx, mut stop) = (halt_tx.clone(), stop_rx.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.changed() => {}
                _ = lost_rx.changed() => tracing::error!("leadership lost"),
            }
            let _ = halt_tx.send(true);
        });
    }

    let mut tasks = Vec::new();
    if args.autoscaler == "builtin" {
        let (ctx, namespaces, halt) = (ctx.clone(), namespaces.clone(), halt_tx.subscribe());
        tasks.push(tokio::spawn(async move {
            builtin_scaler::run(ctx, namespaces, halt).await
        }));
    }
    let targets: Vec<Option<String>> = if namespaces.is_empty() {
        vec![None]
    } else {
        namespaces.into_iter().map(Some).collect()
    };
    health.controllers_starting(targets.len());
    for ns in targets {
        let mut halt = halt_tx.subscribe();
        let shutdown = async move {
            let _ = halt.changed().await;
        };
        tasks.push(tokio::spawn(run_controller(ctx.clone(), ns, shutdown)));
    }
    tracing::info!("controller running");
    for t in tasks {
        t.await.context("controller task panicked")?;
    }
    metrics.is_leader.set(0);
    if !*stop_rx.borrow() {
        // Halted without a shutdown request: leadership was lost. Exit so the pod restarts as a standby.
        bail!("leadership lost");
    }
    if args.leader_election {
        if let Err(e) = leader::release(&leases, &lease_cfg).await {
            tracing::warn!(error = %e, "releasing the lease");
        }
    }
    server.await.context("metrics server task")??;
    tracing::info!("stopped");
    Ok(())
}
