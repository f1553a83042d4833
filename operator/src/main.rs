//! moe-operator: placeholder until the operator issue lands.
fn main() -> anyhow::Result<()> {
    anyhow::bail!("moe-operator is not implemented yet")
}
