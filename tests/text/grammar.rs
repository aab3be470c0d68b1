//! Grammar-constrained sampling and log-probabilities through the library: the random tiny
//! model, which left alone writes no JSON, writes JSON that parses and validates against
//! the schema, and forced tool calls in K3's format whose arguments validate; bad schemas
//! are refused with a reason.

use crate::support;

use k3::generate::{generate, GenerateOptions};
use k3::grammar::constraint::MAX_GRAMMAR_BYTES;
use k3::grammar::{
    CompilerBusy, GrammarCompiler, OutputConstraint, ReplyFrame, SchemaError, ToolSchema,
    MAX_FORCED_TOOLS,
};
use k3::model::FormatPolicy;
use k3::sampling::{logprobs_of, Sampler, SamplerConfig};
use k3::serve::reply::{parse_reply, pieces_from_ids};
use k3::token_picker::TokenPicker;
use k3::tokenizer::{ChatOptions, Message, Tokenizer};
use serde_json::{json, Value};
use std::cell::RefCell;
use support::{cpu_model, serial_stream, tiny};

struct Run {
    tokens: Vec<u32>,
    logprobs: Vec<k3::sampling::TokenLogprobs>,
}

/// Generates up to `ngen` tokens from `prompt` on the tiny model under `c` in `frame`.
fn constrained(
    prompt: &[u32],
    c: Option<(&OutputConstraint, ReplyFrame)>,
    cfg: SamplerConfig,
    ngen: usize,
    top_logprobs: Option<usize>,
) -> Run {
    let dir = tiny(7);
    let model = cpu_model(&dir, FormatPolicy::default(), serial_stream());
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let eos = model.ckpt.config.eos_token_ids.clone();
    let constraint = c.map(|(c, frame)| {
        GrammarCompiler::new(&tok, &eos)
            .unwrap()
            .constrain(c, frame)
            .unwrap()
    });
    let mut stop = eos.clone();
    stop.extend(tok.special_id("<|end_of_msg|>"));
    let picker = RefCell::new(
        TokenPicker::new(Sampler::new(cfg).unwrap(), constraint, top_logprobs).with_budget(ngen),
    );
    let logprobs = RefCell::new(Vec::new());
    let opts = GenerateOptions {
        ngen,
        max_window: Some(16),
        all_logits: false,
        stop_ids: &stop,
        trace: None,
    };
    let g = generate(
        &model,
        prompt,
        &opts,
        &mut |l, h| picker.borrow_mut().pick(l, h),
        &mut |_ev| {
            let mut p = picker.borrow_mut();
            if let Some(e) = p.take_error() {
                return Err(e);
            }
            logprobs.borrow_mut().extend(p.take_logprobs());
            Ok(())
        },
    )
    .unwrap();
    Run {
        tokens: g.tokens,
        logprobs: logprobs.into_inner(),
    }
}

fn chat_prompt(tok: &Tokenizer, thinking: bool) -> Vec<u32> {
    tok.encode_chat(
        &[Message::user("Give me a JSON object describing a cat.")],
        &ChatOptions::generation(thinking),
    )
    .unwrap()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&tiny(7)).unwrap()
}

fn sampled(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.8,
        seed,
        ..SamplerConfig::default()
    }
}

fn no_think() -> ReplyFrame {
    ReplyFrame::Chat {
        thinking: false,
        think_tokens: 0,
    }
}

#[test]
fn unconstrained_tiny_model_writes_no_json() {
    // The premise of the tests below: left alone the random model does not write JSON.
    let tok = tokenizer();
    let run = constrained(&chat_prompt(&tok, false), None, sampled(1), 48, None);
    let reply = parse_reply(&pieces_from_ids(&tok, &run.tokens), false);
    assert!(serde_json::from_str::<Value>(&reply.content).is_err());
}

#[test]
fn json_object_parses_in_a_chat_reply() {
    let tok = tokenizer();
    for (seed, cfg) in [
        (0, SamplerConfig::default()),
        (1, sampled(1)),
        (2, sampled(2)),
    ] {
        let run = constrained(
            &chat_prompt(&tok, false),
            Some((&OutputConstraint::JsonObject, no_think())),
            cfg,
            400,
            None,
        );
        assert_eq!(
            run.tokens.last(),
            tok.special_id("<|end_of_msg|>").as_ref(),
            "seed {seed}: the reply ends its message"
        );
        let reply = parse_reply(&pieces_from_ids(&tok, &run.tokens), false);
        let v: Value = serde_json::from_str(&reply.content)
            .unwrap_or_else(|e| panic!("seed {seed}: {:?} is not JSON: {e}", reply.content));
        assert!(v.is_object(), "seed {seed}: {v}");
    }
}

#[test]
fn json_schema_validates_with_and_without_thinking() {
    let tok = tokenizer();
    let schema = support::cat_schema();
    let c = OutputConstraint::JsonSchema {
        schema: schema.clone(),
        strict: true,
    };
    for thinking in [false, true] {
        let frame = ReplyFrame::Chat {
            thinking,
            think_tokens: 12,
        };
        let run = constrained(
            &chat_prompt(&tok, thinking),
            Some((&c, frame)),
            sampled(3),
            400,
            None,
        );
        let reply = parse_reply(&pieces_from_ids(&tok, &run.tokens), thinking);
        let v: Value = serde_json::from_str(&reply.content)
            .unwrap_or_else(|e| panic!("thinking {thinking}: {:?}: {e}", reply.content));
        support::assert_valid(&schema, &v);
    }
}

#[test]
fn a_strict_object_that_leaves_additional_properties_out_writes_each_key_once() {
    let tok = tokenizer();
    // Open by JSON Schema's default: under strict it is closed, so every key the model
    // writes is a declared one, each once (extra keys could repeat one another).
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"},
        "b": {"type": "string", "maxLength": 8}}, "required": ["a"]});
    let c = OutputConstraint::JsonSchema {
        schema: schema.clone(),
        strict: true,
    };
    for seed in 0..6 {
        let prompt = tok.try_encode("Object:").unwrap();
        let run = constrained(
            &prompt,
            Some((&c, ReplyFrame::Bare)),
            sampled(seed),
            200,
            None,
        );
        let text = tok.decode(&run.tokens, false).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        support::assert_valid(&schema, &v);
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert!(
            keys.iter().all(|k| *k == "a" || *k == "b"),
            "seed {seed}: {text}"
        );
        // serde_json keeps the last of repeated keys: count them in the text.
        assert_eq!(text.matches("\"a\":").count(), 1, "seed {seed}: {text}");
    }
}

#[test]
fn bare_frame_is_json_then_eos() {
    let tok = tokenizer();
    let schema = json!({"type": "array", "items": {"type": "integer"}, "maxItems": 4});
    let c = OutputConstraint::JsonSchema {
        schema: schema.clone(),
        strict: false,
    };
    let prompt = tok.try_encode("Numbers:").unwrap();
    let run = constrained(&prompt, Some((&c, ReplyFrame::Bare)), sampled(4), 200, None);
    let text = tok.decode(&run.tokens, false).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    support::assert_valid(&schema, &v);
}

#[test]
fn forced_tool_call_is_k3_format_with_valid_arguments() {
    let tok = tokenizer();
    let weather = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"enum": ["c", "f"]}
        },
        "required": ["city", "unit"],
        "additionalProperties": false
    });
    let time = json!({
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"],
        "additionalProperties": false
    });
    let tools = vec![
        ToolSchema {
            name: "get_weather".into(),
            parameters: weather.clone(),
            strict: true,
        },
        ToolSchema {
            name: "get_time".into(),
            parameters: time.clone(),
            strict: false,
        },
    ];
    for (seed, offered) in [(5, tools.clone()), (6, tools[1..].to_vec())] {
        let c = OutputConstraint::ToolCall {
            tools: offered.clone(),
        };
        let run = constrained(
            &chat_prompt(&tok, false),
            Some((&c, no_think())),
            sampled(seed),
            400,
            None,
        );
        let reply = parse_reply(&pieces_from_ids(&tok, &run.tokens), false);
        assert_eq!(reply.tool_calls.len(), 1, "seed {seed}: {reply:?}");
        assert!(reply.unparsed_tools.is_empty(), "{reply:?}");
        let call = &reply.tool_calls[0];
        let tool = offered
            .iter()
            .find(|t| t.name == call.name)
            .unwrap_or_else(|| panic!("{} was not offered", call.name));
        let args: Value = serde_json::from_str(&call.arguments).unwrap();
        support::assert_valid(&tool.parameters, &args);
    }
}

#[test]
fn logprobs_are_the_sampled_distribution() {
    let tok = tokenizer();
    let prompt = tok.try_encode("Once upon a time").unwrap();
    // Greedy: the chosen id is the most likely one.
    let run = constrained(&prompt, None, SamplerConfig::default(), 6, Some(5));
    assert_eq!(run.logprobs.len(), run.tokens.len());
    for (lp, &id) in run.logprobs.iter().zip(&run.tokens) {
        assert_eq!(lp.id, id);
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0], (id, lp.logprob));
        assert!(lp.logprob <= 0.0);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    // Under a grammar the masked ids have no probability: every alternative is allowed.
    let c = OutputConstraint::JsonObject;
    let run = constrained(
        &chat_prompt(&tok, false),
        Some((&c, no_think())),
        sampled(8),
        60,
        Some(20),
    );
    let open = tok.special_id("<|open|>").unwrap();
    for lp in &run.logprobs {
        assert!(lp.top.iter().all(|&(id, l)| id != open && l.is_finite()));
        let total: f32 = lp.top.iter().map(|&(_, l)| l.exp()).sum();
        assert!(total <= 1.0 + 1e-4, "{total}");
    }
    // The first step of a JSON object can only open it.
    assert_eq!(
        tok.decode(&[run.tokens[0]], false).unwrap().chars().next(),
        Some('{')
    );
}

#[test]
fn logprobs_follow_the_temperature() {
    let logits = [2.0f32, 1.0, 0.0, f32::NEG_INFINITY];
    let lp = logprobs_of(&logits, 0.5, 1, 10);
    let z: f64 = [4.0f64, 2.0, 0.0].iter().map(|x| x.exp()).sum();
    assert!((lp.logprob as f64 - (2.0 - z.ln())).abs() < 1e-5);
    assert_eq!(lp.top.len(), 3, "the -inf id is left out");
    let greedy = logprobs_of(&logits, 0.0, 0, 1);
    let z1: f64 = [2.0f64, 1.0, 0.0].iter().map(|x| x.exp()).sum();
    assert!((greedy.logprob as f64 - (2.0 - z1.ln())).abs() < 1e-5);
}

#[test]
fn bad_schemas_are_refused_with_a_reason() {
    let dir = tiny(7);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let g = GrammarCompiler::new(&tok, &[tok.special_id("<|end_of_msg|>").unwrap()]).unwrap();
    let err = |schema: Value, strict: bool| {
        g.constrain(
            &OutputConstraint::JsonSchema { schema, strict },
            ReplyFrame::Bare,
        )
        .err()
        .map(|e| format!("{e:#}"))
    };
    let e = err(json!(false), true).unwrap();
    assert!(e.contains("no value satisfies it"), "{e}");
    let e = err(json!([1, 2]), false).unwrap();
    assert!(e.contains("must be an object"), "{e}");
    let e = err(
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        true,
    )
    .unwrap();
    assert!(e.contains("does not compile") && !e.contains('\n'), "{e}");
    let e = err(json!({"type": "object", "x-guidance": 3}), true).unwrap();
    assert!(e.contains("x-guidance"), "{e}");
    assert!(GrammarCompiler::new(&tok, &[]).is_err());
    let e = GrammarCompiler::new(&tok, &[u32::MAX])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("outside the tokenizer"), "{e}");
}

/// Whether the grammar of `schema` (bare frame) accepts exactly `text`.
fn accepts(g: &GrammarCompiler, tok: &Tokenizer, schema: &Value, text: &str) -> bool {
    let c = OutputConstraint::JsonSchema {
        schema: schema.clone(),
        strict: true,
    };
    let mut k = g.constrain(&c, ReplyFrame::Bare).unwrap();
    for id in tok.try_encode(text).unwrap() {
        if !k.allows(id).unwrap() {
            return false;
        }
        k.commit(id).unwrap();
    }
    let eos = tok.special_id("<|end_of_msg|>").unwrap();
    k.allows(eos).unwrap()
}

fn compiler(tok: &Tokenizer) -> GrammarCompiler {
    GrammarCompiler::new(tok, &[tok.special_id("<|end_of_msg|>").unwrap()]).unwrap()
}

#[test]
fn an_integer_is_an_integer_and_a_number_a_finite_decimal() {
    let tok = tokenizer();
    let g = compiler(&tok);
    let int = json!({"type": "integer"});
    for t in [
        "0",
        "-5",
        "42",
        "9223372036854774784",
        "-9223372036854774784",
    ] {
        assert!(accepts(&g, &tok, &int, t), "integer {t}");
    }
    for t in [
        "-0",
        "12345678901234567890123",
        "9223372036854775807",
        "1e5",
        "1.0",
    ] {
        assert!(!accepts(&g, &tok, &int, t), "integer {t}");
    }
    let num = json!({"type": "number"});
    for t in ["0", "1.5", "-0.25", "9007199254740992"] {
        assert!(accepts(&g, &tok, &num, t), "number {t}");
    }
    for t in ["1e999", "1.5e3", "9007199254740993"] {
        assert!(!accepts(&g, &tok, &num, t), "number {t}");
    }
    // A schema's own bounds still hold beside the grammar's.
    let small = json!({"type": "integer", "minimum": -3, "maximum": 3});
    assert!(accepts(&g, &tok, &small, "-3") && !accepts(&g, &tok, &small, "-0"));
    assert!(!accepts(&g, &tok, &small, "4"));
    // json_object: the values inside are shaped the same way.
    let c = OutputConstraint::JsonObject;
    let mut k = g.constrain(&c, ReplyFrame::Bare).unwrap();
    let mut ok = true;
    for id in tok.try_encode("{\"a\":[1e999]}").unwrap() {
        ok &= k.allows(id).unwrap();
        if !ok {
            break;
        }
        k.commit(id).unwrap();
    }
    assert!(!ok, "json_object allowed an exponent");

    // Sampled at temperature 1, a forced integer field parses as an i64 every time.
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"},
        "x": {"type": "number"}}, "required": ["n", "x"], "additionalProperties": false});
    let c = OutputConstraint::JsonSchema {
        schema: schema.clone(),
        strict: true,
    };
    for seed in 0..12 {
        let cfg = SamplerConfig {
            temperature: 1.0,
            seed,
            ..SamplerConfig::default()
        };
        let run = constrained(
            &chat_prompt(&tok, false),
            Some((&c, no_think())),
            cfg,
            120,
            None,
        );
        let reply = parse_reply(&pieces_from_ids(&tok, &run.tokens), false);
        let v: Value = serde_json::from_str(&reply.content)
            .unwrap_or_else(|e| panic!("seed {seed}: {:?}: {e}", reply.content));
        assert!(v["n"].is_i64(), "seed {seed}: {}", reply.content);
        assert!(
            !reply.content.contains("-0,") && !reply.content.contains(['e', 'E']),
            "seed {seed}: {}",
            reply.content
        );
        assert!(
            v["x"].as_f64().is_some_and(f64::is_finite),
            "seed {seed}: {}",
            reply.content
        );
    }
}

#[test]
fn what_the_grammar_cannot_enforce_is_refused_naming_the_schema_path() {
    let tok = tokenizer();
    let g = compiler(&tok);
    let refused = |schema: &str, strict: bool| -> SchemaError {
        let c = OutputConstraint::JsonSchema {
            schema: serde_json::from_str(schema).unwrap(),
            strict,
        };
        let e = g
            .constrain(&c, ReplyFrame::Bare)
            .err()
            .unwrap_or_else(|| panic!("{schema} compiled"));
        e.downcast_ref::<SchemaError>()
            .unwrap_or_else(|| panic!("{schema}: {e:#}"))
            .clone()
    };
    for (schema, path) in [
        (r#"{"type":"integer","minimum":1e29}"#, ".minimum"),
        (
            r#"{"type":"integer","minimum":18446744073709551616}"#,
            ".minimum",
        ),
        (
            r#"{"properties":{"n":{"type":"integer","const":18446744073709551616}}}"#,
            ".properties.n.const",
        ),
        (
            r#"{"properties":{"n":{"enum":[2, 100000000000000000000000000000]}}}"#,
            ".properties.n.enum[1]",
        ),
        (r#"{"type":"object","minProperties":3}"#, ".minProperties"),
        // Extra keys may repeat one another: refused under strict, naming the keyword.
        (
            r#"{"type":"object","additionalProperties":true}"#,
            ".additionalProperties",
        ),
        (
            r#"{"properties":{"m":{"type":"object","additionalProperties":{"type":"integer"}}}}"#,
            ".properties.m.additionalProperties",
        ),
        (
            r#"{"type":"object","patternProperties":{"^x":{"type":"string"}},"additionalProperties":false}"#,
            ".patternProperties",
        ),
    ] {
        assert_eq!(refused(schema, true).path, path, "{schema}");
    }
    assert_eq!(refused(r#"{"const":1e29}"#, false).path, ".const");
    // Lenient, an unenforceable minProperties is ignored, as other keywords are: no
    // repeated keys are forced.
    let c = OutputConstraint::JsonSchema {
        schema: json!({"type": "object", "minProperties": 3}),
        strict: false,
    };
    assert!(g.constrain(&c, ReplyFrame::Bare).is_ok());
    // What it enforces exactly still compiles.
    let c = OutputConstraint::JsonSchema {
        schema: json!({"type": "object", "properties": {"a": {}, "b": {}},
            "minProperties": 1, "additionalProperties": false}),
        strict: true,
    };
    assert!(g.constrain(&c, ReplyFrame::Bare).is_ok());
}

#[test]
fn compiles_are_bounded_in_size_and_number() {
    let tok = tokenizer();
    let g = compiler(&tok).with_max_compiles(1);
    let tool = |i: usize| ToolSchema {
        name: format!("f{i}"),
        parameters: json!({"type": "object"}),
        strict: false,
    };
    let many = OutputConstraint::ToolCall {
        tools: (0..MAX_FORCED_TOOLS + 1).map(tool).collect(),
    };
    let e = format!("{:#}", g.constrain(&many, no_think()).err().unwrap());
    assert!(e.contains("at most 128"), "{e}");
    let huge = OutputConstraint::JsonSchema {
        schema: json!({"type": "object", "description": "d".repeat(MAX_GRAMMAR_BYTES)}),
        strict: false,
    };
    let e = format!("{:#}", g.constrain(&huge, ReplyFrame::Bare).err().unwrap());
    assert!(e.contains("bytes; at most"), "{e}");
    // One compile at once: a second waits for none and is refused as busy.
    let slot = g.try_slot().unwrap();
    let e = g
        .constrain(&OutputConstraint::JsonObject, ReplyFrame::Bare)
        .err()
        .unwrap();
    assert!(e.is::<CompilerBusy>(), "{e:#}");
    drop(slot);
    assert!(g
        .constrain(&OutputConstraint::JsonObject, ReplyFrame::Bare)
        .is_ok());
}
