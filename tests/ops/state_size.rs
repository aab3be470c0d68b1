//! The conversation state the RAM clamp reserves: KV grows with the context, KDA does not.

use k3::config::Config;
use k3::model::state_size::state_size;

#[test]
fn kv_grows_with_the_context_and_kda_does_not() {
    let cfg = Config::tiny();
    let (a, b) = (state_size(&cfg, 1000), state_size(&cfg, 3000));
    assert!(a.kv_gb > 0.0 && a.kda_gb > 0.0, "{a:?}");
    assert!((b.kv_gb - 3.0 * a.kv_gb).abs() < 1e-15, "{a:?} {b:?}");
    assert_eq!(a.kda_gb, b.kda_gb);
    assert_eq!(state_size(&cfg, 0).kv_gb, 0.0);
    // One MLA layer (kv_lora 8 + rope 2 floats a token) and two KDA layers (2 heads of 8x8
    // plus 3 convolutions' 3 past rows of the KDA width).
    assert!((a.kv_gb - 1000.0 * 10.0 * 4.0 / 1e9).abs() < 1e-15, "{a:?}");
}
