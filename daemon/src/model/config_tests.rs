//! Tests of `config.json` parsing.
use super::*;
use serde_json::json;

fn base() -> Value {
    json!({"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 100, "head_dim": 32,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
           "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "eos_token_id": [2, 3]})
}

#[test]
fn classic_and_rope_parameters_forms_agree() {
    let classic = ModelConfig::from_json(&base()).unwrap();
    let mut v = base();
    let o = v.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("partial_rotary_factor");
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    );
    let newer = ModelConfig::from_json(&v).unwrap();
    assert_eq!(classic.rope, newer.rope);
    assert_eq!(classic.rope.rotary_dim, 16);
    assert_eq!(classic.moe_layers, vec![false, true, true]);
    assert_eq!(classic.eos_token_ids, vec![2, 3]);
    assert_eq!(classic.moe.as_ref().unwrap().shared_intermediate, Some(16));
}

#[test]
fn unknown_architecture_lists_supported() {
    let mut v = base();
    v["architectures"] = json!(["FancyForCausalLM"]);
    let e = ModelConfig::from_json(&v).unwrap_err().to_string();
    assert!(
        e.contains("FancyForCausalLM") && e.contains("Qwen3MoeForCausalLM"),
        "{e}"
    );
}

fn smallthinker() -> Value {
    json!({"architectures": ["SmallThinkerForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 100,
           "moe_num_primary_experts": 8, "moe_num_active_primary_experts": 2, "moe_ffn_hidden_size": 16,
           "rope_layout": [0, 1, 1, 1], "sliding_window_layout": [0, 1, 1, 1], "sliding_window_size": 5})
}

#[test]
fn smallthinker_layouts_router_and_class_defaults() {
    let c = ModelConfig::from_json(&smallthinker()).unwrap();
    assert_eq!(c.arch, Arch::SmallThinker);
    assert_eq!(c.activation, Activation::Relu);
    assert_eq!(
        c.head_dim, 128,
        "the config class default, not hidden/heads"
    );
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rope.theta, 1e6);
    assert_eq!(c.eos_token_ids, vec![151643, 151645]);
    let full = LayerAttention {
        rope: false,
        window: None,
    };
    let swa = LayerAttention {
        rope: true,
        window: Some(5),
    };
    assert_eq!(c.layer_attention, vec![full, swa, swa, swa]);
    assert_eq!(swa.first_attended(3), 0);
    assert_eq!(swa.first_attended(9), 5);
    let m = c.moe.unwrap();
    assert_eq!(m.router_input, RouterInput::LayerInput);
    assert_eq!(c.moe_layers, vec![true; 4]);
    assert!(matches!(
        m.router,
        RouterKind::SigmoidGrouped {
            n_group: 1,
            renormalize: true,
            ..
        }
    ));
    let mut v = smallthinker();
    v["moe_primary_router_apply_softmax"] = json!(true);
    v["tie_word_embeddings"] = json!(false);
    let c = ModelConfig::from_json(&v).unwrap();
    assert!(!c.tie_word_embeddings);
    assert_eq!(
        c.moe.unwrap().router,
        RouterKind::Softmax { renormalize: true }
    );
}

#[test]
fn smallthinker_bad_layouts_are_errors() {
    for (key, bad) in [
        ("rope_layout", json!([1, 1])),
        ("sliding_window_layout", json!([0, 2, 0, 0])),
        ("rope_layout", json!("all")),
    ] {
        let mut v = smallthinker();
        v[key] = bad;
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains(key), "{e}");
    }
    let mut v = smallthinker();
    v["sliding_window_size"] = json!(0);
    assert!(ModelConfig::from_json(&v).is_err());
    // other architectures: every layer full attention with RoPE
    let c = ModelConfig::from_json(&base()).unwrap();
    assert_eq!(c.layer_attention, vec![LayerAttention::FULL; 3]);
}

#[test]
fn bad_fields_are_errors_not_panics() {
    let mut v = base();
    v["num_key_value_heads"] = json!(3);
    assert!(ModelConfig::from_json(&v).is_err());
    let mut v = base();
    v["num_experts_per_tok"] = json!(9);
    assert!(ModelConfig::from_json(&v).is_err());
    let mut v = base();
    v.as_object_mut().unwrap().remove("hidden_size");
    assert!(matches!(
        ModelConfig::from_json(&v),
        Err(ConfigError::Field("hidden_size"))
    ));
}
