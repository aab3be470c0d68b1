//! `k3 serve --parallel`: several requests in flight at once, advanced together a batched
//! step at a time. Each test checks a property the one-at-a-time engine lacks.

use crate::serve_support;
use crate::support;

use serde_json::{json, Value};
use serve_support::*;
use std::io::{BufRead, BufReader, Read};
use std::time::{Duration, Instant};

/// A greedy chat of `max_tokens` tokens that ignores end-of-sequence, so it runs its length.
fn long_chat(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    })
}

/// The parts of an answer that must not depend on what else ran beside it.
fn answer_key(v: &Value) -> Value {
    let c = &v["choices"][0];
    json!({
        "content": c["message"]["content"],
        "reasoning": c["message"]["reasoning_content"],
        "finish": c["finish_reason"],
        "logprobs": c["logprobs"],
        "tokens": v["usage"]["completion_tokens"],
    })
}

/// `/health` as JSON.
fn health(s: &Server) -> Value {
    let (st, body) = get(&s.url("/health"), None);
    assert_eq!(st, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Polls `/health` until `f` holds, for up to `secs`; returns the last reading.
fn wait_until(s: &Server, secs: u64, f: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let h = health(s);
        if f(&h) || t.elapsed() > Duration::from_secs(secs) {
            return h;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The sequences `/health` lists in `state`.
fn in_state(h: &Value, state: &str) -> usize {
    h["sequences"]
        .as_array()
        .map_or(0, |a| a.iter().filter(|q| q["state"] == state).count())
}

/// Reads an SSE stream's lines until its first chunk with text (a token), returning when.
fn first_text(r: &mut dyn BufRead) -> Instant {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "the stream ended");
        if let Some(data) = line.strip_prefix("data: ") {
            if let Ok(v) = serde_json::from_str::<Value>(data.trim()) {
                let d = &v["choices"][0]["delta"];
                let text = |k: &str| d[k].as_str().is_some_and(|t| !t.is_empty());
                if text("content") || text("reasoning_content") {
                    return Instant::now();
                }
            }
        }
    }
}

#[test]
fn concurrent_requests_get_the_greedy_tokens_they_get_alone() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--parallel", "4"]);
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}},
        "required": ["a"], "additionalProperties": false});
    let bodies = [
        long_chat("Tell me about the sea", 40, false),
        long_chat("Write a short poem", 33, false),
        // Logprobs and a grammar in the batch.
        json!({"messages": [{"role": "user", "content": "Count to ten"}], "max_tokens": 30,
            "temperature": 0, "logprobs": true, "top_logprobs": 2}),
        json!({"messages": [{"role": "user", "content": "Answer in JSON"}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
    ];
    let url = s.url("/v1/chat/completions");
    let alone: Vec<Value> = bodies
        .iter()
        .map(|b| {
            let (st, v) = post_json(&url, b);
            assert_eq!(st, 200, "{v}");
            answer_key(&v)
        })
        .collect();
    for round in 0..2 {
        let together: Vec<Value> = std::thread::scope(|sc| {
            let hs: Vec<_> = bodies
                .iter()
                .map(|b| {
                    let url = url.clone();
                    sc.spawn(move || post_json(&url, b))
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    let (st, v) = h.join().unwrap();
                    assert_eq!(st, 200, "{v}");
                    answer_key(&v)
                })
                .collect()
        });
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a, t, "round {round}, request {i}: alone vs together");
        }
    }
    // They ran together: steps of more than one sequence.
    let (st, m) = get(&s.url("/metrics"), None);
    assert_eq!(st, 200);
    let count = |name: &str| -> f64 { metric(&m, name) };
    let steps = count("k3_batch_size_count");
    let alone_steps = count("k3_batch_size_bucket{le=\"1\"}");
    assert!(
        steps > alone_steps,
        "no step ran more than one sequence: {m}"
    );
    assert!(m.contains("k3_active_sequences 0"), "{m}");
    assert!(s.log().contains("| batch "), "{}", s.log());
}

#[test]
fn a_disconnect_mid_batch_frees_its_slot_for_the_next_queued_request() {
    let dir = support::tiny(0);
    let s = Server::start(
        &dir,
        &["--parallel", "2", "--queue", "4", "--max-tokens", "65536"],
    );
    let url = s.url("/v1/chat/completions");
    let mut a = BufReader::new(open_stream(&url, &long_chat("first", 20000, true)));
    first_text(&mut a);
    let mut b = BufReader::new(open_stream(&url, &long_chat("second", 20000, true)));
    first_text(&mut b);
    let h = wait_until(&s, 20, |h| in_state(h, "decode") == 2);
    assert_eq!(in_state(&h, "decode"), 2, "{h}");
    // The third waits for a slot; when the first client leaves, it gets the first's slot
    // while the second still decodes.
    let third = std::thread::spawn({
        let url = url.clone();
        move || post_json(&url, &long_chat("third", 5, false))
    });
    let h = wait_until(&s, 20, |h| h["queue_depth"] == 1);
    assert_eq!(h["queue_depth"], 1, "{h}");
    drop(a);
    let (st, v) = third.join().unwrap();
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    let h = health(&s);
    assert_eq!(in_state(&h, "decode"), 1, "the second stopped: {h}");
    let mut buf = [0u8; 256];
    assert!(b.read(&mut buf).unwrap() > 0, "the second still streams");
    assert!(s.log().contains("(cancelled)"), "{}", s.log());
}

#[test]
fn only_a_full_queue_answers_429() {
    let dir = support::tiny(0);
    let s = Server::start(
        &dir,
        &["--parallel", "2", "--queue", "1", "--max-tokens", "65536"],
    );
    let url = s.url("/v1/chat/completions");
    let mut running = Vec::new();
    for (i, p) in ["one", "two"].iter().enumerate() {
        let mut r = BufReader::new(open_stream(&url, &long_chat(p, 20000, true)));
        first_text(&mut r);
        running.push(r);
        let h = wait_until(&s, 20, |h| in_state(h, "decode") == i + 1);
        assert_eq!(in_state(&h, "decode"), i + 1, "{h}");
    }
    // Both slots run: the next request waits in the queue's one place, the one after is 429.
    let waiting = open_stream(&url, &long_chat("three", 3, true));
    let h = wait_until(&s, 20, |h| h["queue_depth"] == 1);
    assert_eq!(h["queue_depth"], 1, "{h}");
    let (st, retry, v) = post(&url, &long_chat("four", 3, false).to_string(), None);
    assert_eq!((st, retry.as_deref()), (429, Some("1")), "{v}");
    drop(waiting);
    drop(running);
    let h = wait_until(&s, 30, |h| {
        h["sequences"].as_array().is_some_and(|a| a.is_empty())
    });
    assert_eq!(h["state"], "idle", "{h}");
}

#[test]
fn a_short_chat_gets_its_first_token_while_a_long_prompt_prefills() {
    let dir = support::tiny(0);
    let s = Server::start(
        &dir,
        &[
            "--parallel",
            "2",
            "--prefill-slice",
            "16",
            "--max-tokens",
            "16384",
        ],
    );
    let url = s.url("/v1/chat/completions");
    let mut long = BufReader::new(open_stream(
        &url,
        &long_chat(&"word ".repeat(6000), 2, true),
    ));
    let h = wait_until(&s, 30, |h| in_state(h, "prefill") == 1);
    let q = &h["sequences"][0];
    assert_eq!(q["state"], "prefill", "{h}");
    assert!(q["prompt_tokens"].as_u64().unwrap() > 6000, "{h}");
    assert!(
        q["prefilled_tokens"].as_u64().unwrap() < q["prompt_tokens"].as_u64().unwrap(),
        "{h}"
    );
    let mut short = BufReader::new(open_stream(&url, &long_chat("hi", 4, true)));
    let short_first = first_text(&mut short);
    // The long one is still prefilling when the short one has its first token.
    let h = health(&s);
    let long_first = first_text(&mut long);
    assert!(short_first < long_first, "{h}");
    assert!(
        h["sequences"]
            .as_array()
            .unwrap()
            .iter()
            .any(|q| q["state"] == "prefill"),
        "the long prompt was not prefilling any more: {h}"
    );
}

#[test]
fn bad_parallel_and_prefill_slice_are_refused_naming_the_flag() {
    let dir = support::tiny(0);
    for (flag, value) in [
        ("--parallel", "0"),
        ("--parallel", "65"),
        ("--prefill-slice", "0"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
            .arg("serve")
            .arg(&dir)
            .args(["--port", "0", flag, value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} was accepted");
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
}

#[test]
fn a_request_whose_state_does_not_fit_beside_the_running_one_waits() {
    let dir = support::tiny(0);
    // A 1 GB budget leaves no room beside the fixed reserve: the plan reserves the first
    // sequence's state only (overcommit keeps one expert slot a layer).
    let s = Server::start(
        &dir,
        &[
            "--parallel",
            "2",
            "--max-tokens",
            "4096",
            "--ram-gb",
            "1",
            "--ram-overcommit",
            "1",
        ],
    );
    assert!(
        s.log().contains(
            "[K3] state: 1 of the 2 sequences asked (--parallel) fit at the full context"
        ),
        "{}",
        s.log()
    );
    let url = s.url("/v1/chat/completions");
    let mut a = BufReader::new(open_stream(&url, &long_chat("one", 3000, true)));
    first_text(&mut a);
    // Two answers of 3000 tokens do not fit one 4096-token context's state: the second waits.
    let b = std::thread::spawn({
        let url = url.clone();
        move || post_json(&url, &long_chat("two", 3000, false))
    });
    assert!(s.wait_log("waits in the queue", 20), "{}", s.log());
    let h = health(&s);
    assert_eq!(
        (in_state(&h, "decode"), &h["queue_depth"]),
        (1, &json!(1)),
        "{h}"
    );
    drop(a);
    let (st, v) = b.join().unwrap();
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        s.log().matches("waits in the queue").count(),
        1,
        "{}",
        s.log()
    );
}

#[test]
fn two_context_sized_requests_run_at_once_when_the_plan_reserves_two_states() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--parallel", "2", "--max-tokens", "4096"]);
    assert!(
        s.log()
            .contains("[K3] state: 2 sequences at the full context (--parallel): 2 x "),
        "{}",
        s.log()
    );
    assert!(
        s.wait_log("sharing 2.7 MB of state (2 4096-token contexts)", 20),
        "{}",
        s.log()
    );
    let url = s.url("/v1/chat/completions");
    // Each answer needs most of a 4096-token context's state: with a state reserved for
    // each, both decode together and neither waits.
    let mut a = BufReader::new(open_stream(&url, &long_chat("one", 3000, true)));
    first_text(&mut a);
    let mut b = BufReader::new(open_stream(&url, &long_chat("two", 3000, true)));
    first_text(&mut b);
    let h = wait_until(&s, 20, |h| in_state(h, "decode") == 2);
    assert_eq!(in_state(&h, "decode"), 2, "{h}");
    assert!(!s.log().contains("waits in the queue"), "{}", s.log());
}

/// Steps the engine has run (`k3_batch_size_count` in /metrics).
fn steps_run(s: &Server) -> f64 {
    let (st, m) = get(&s.url("/metrics"), None);
    assert_eq!(st, 200, "{m}");
    metric(&m, "k3_batch_size_count")
}

#[test]
fn a_lone_prompt_feeds_whole_windows_when_the_cache_cannot_hold_every_expert() {
    let dir = support::tiny(0);
    // 400 words at 16 tokens a slice: 25 or more prefill steps when sliced.
    let body = long_chat(&"word ".repeat(400), 1, false);
    let steps_with = |flags: &[&str]| {
        let mut args = vec!["--parallel", "2", "--prefill-slice", "16"];
        args.extend_from_slice(flags);
        let s = Server::start(&dir, &args);
        let (st, b) = post_json(&s.url("/v1/chat/completions"), &body);
        assert_eq!(st, 200, "{b}");
        steps_run(&s)
    };
    // The tiny model's 4 experts a layer all fit the default cache: slices cost nothing.
    let all_held = steps_with(&[]);
    assert!(
        all_held >= 25.0,
        "a lone prompt was not sliced: {all_held} steps"
    );
    // A cache of fewer slots than experts: slices would re-read experts, so whole windows.
    let few_held = steps_with(&["--expert-gb", "0.000001"]);
    assert!(
        few_held <= 3.0,
        "a lone prompt was sliced: {few_held} steps"
    );
}

/// One choice of an answer, without its index: what must not depend on how it ran.
fn choice_key(c: &Value) -> Value {
    json!({
        "content": c["message"]["content"],
        "reasoning": c["message"]["reasoning_content"],
        "finish": c["finish_reason"],
        "logprobs": c["logprobs"],
    })
}

#[test]
fn n_choices_run_as_sequences_of_their_own_with_the_tokens_each_gets_alone() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--parallel", "4", "--max-tokens", "65536"]);
    let url = s.url("/v1/chat/completions");
    let alone = |body: &Value| {
        let (st, v) = post_json(&url, body);
        assert_eq!(st, 200, "{v}");
        choice_key(&v["choices"][0])
    };
    // Greedy, n = 2: both choices are the greedy answer.
    let mut greedy = long_chat("Tell me about the sea", 24, false);
    greedy["logprobs"] = json!(true);
    let one = alone(&greedy);
    greedy["n"] = json!(2);
    let (st, v) = post_json(&url, &greedy);
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(choice_key(c), one, "greedy choice {i}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 48, "{v}");
    // Seeded sampling, n = 3: choice i samples with seed + i, as a request of that seed alone.
    let sampled = json!({"messages": [{"role": "user", "content": "Pick some words"}],
        "max_tokens": 16, "temperature": 1.5, "seed": 11, "ignore_eos": true, "n": 3});
    let (st, v) = post_json(&url, &sampled);
    assert_eq!(st, 200, "{v}");
    for i in 0..3u64 {
        let mut single = sampled.clone();
        single["n"] = json!(1);
        single["seed"] = json!(11 + i);
        assert_eq!(
            choice_key(&v["choices"][i as usize]),
            alone(&single),
            "sampled choice {i}"
        );
    }
    // The request's log line counts the tokens of its three choices.
    let id = v["id"].as_str().unwrap().trim_start_matches("chatcmpl-");
    let line = s
        .log()
        .lines()
        .find(|l| l.contains(&format!("serve {id}: prompt")))
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no log line of {id}: {}", s.log()));
    assert!(line.contains("generated 48"), "{line}");
    // While they run, /health lists one sequence per choice, decoding together.
    let mut stream = long_chat("Go on and on", 5000, true);
    stream["n"] = json!(3);
    let mut r = BufReader::new(open_stream(&url, &stream));
    first_text(&mut r);
    let h = wait_until(&s, 20, |h| in_state(h, "decode") == 3);
    let seqs = h["sequences"].as_array().unwrap();
    assert_eq!(in_state(&h, "decode"), 3, "{h}");
    assert!(seqs.iter().all(|q| q["id"] == seqs[0]["id"]), "{h}");
    let mut choices: Vec<u64> = seqs.iter().map(|q| q["choice"].as_u64().unwrap()).collect();
    choices.sort_unstable();
    assert_eq!(choices, [0, 1, 2], "{h}");
    // Another request still finds a slot beside them; one of two choices waits for two.
    let (st, v) = post_json(&url, &long_chat("short", 3, false));
    assert_eq!(st, 200, "{v}");
    let mut pair = long_chat("a pair", 3, false);
    pair["n"] = json!(2);
    let pair = std::thread::spawn({
        let url = url.clone();
        move || post_json(&url, &pair)
    });
    assert!(
        s.wait_log("waits in the queue for 2 free slots", 20),
        "{}",
        s.log()
    );
    assert_eq!(health(&s)["queue_depth"], 1);
    drop(r);
    let (st, v) = pair.join().unwrap();
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(2), "{v}");
    let h = wait_until(&s, 30, |h| {
        h["sequences"].as_array().is_some_and(|a| a.is_empty())
    });
    assert_eq!(h["state"], "idle", "{h}");
    // More choices than sequences at once is refused, naming both.
    let mut wide = long_chat("x", 2, false);
    wide["n"] = json!(5);
    let (st, v) = post_json(&url, &wide);
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "n", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--parallel") && msg.contains('5'), "{msg}");
}

#[test]
fn streamed_choices_interleave_by_index_and_join_to_the_whole_answers() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--parallel", "3"]);
    for (route, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Say things"}], "max_tokens": 20,
                "temperature": 1.2, "seed": 5, "ignore_eos": true, "n": 3,
                "chat_template_kwargs": {"enable_thinking": false}}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": 20, "temperature": 1.2,
                "seed": 5, "ignore_eos": true, "n": 3}),
        ),
    ] {
        let url = s.url(route);
        let (st, whole) = post_json(&url, &body);
        assert_eq!(st, 200, "{whole}");
        let text = |c: &Value| {
            c["message"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .unwrap()
                .to_string()
        };
        let want: Vec<String> = whole["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(text)
            .collect();
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (st, chunks) = post_stream(&url, &streamed);
        assert_eq!(st, 200);
        let mut got = vec![String::new(); 3];
        let mut finishes = [0; 3];
        let mut order = Vec::new();
        for ch in &chunks {
            for c in ch["choices"].as_array().into_iter().flatten() {
                let i = c["index"].as_u64().unwrap() as usize;
                let piece = c["delta"]["content"].as_str().or(c["text"].as_str());
                if let Some(t) = piece.filter(|t| !t.is_empty()) {
                    got[i].push_str(t);
                    order.push(i);
                }
                finishes[i] += usize::from(c["finish_reason"].is_string());
            }
        }
        assert_eq!(got, want, "{route}");
        assert_eq!(finishes, [1, 1, 1], "{route}");
        // The choices decode together: their pieces come interleaved, not one after another.
        let switches = order.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(switches > 2, "{route}: pieces in order {order:?}");
    }
}

/// The expert counters of request `id`'s log line: needed, cached, bytes read.
fn expert_counts(log: &str, id: &str) -> [u64; 3] {
    let line = log
        .lines()
        .find(|l| l.contains(&format!("serve {id}: prompt")))
        .unwrap_or_else(|| panic!("no log line of {id}: {log}"));
    let part = line
        .split(" | ")
        .find_map(|p| p.strip_prefix("experts "))
        .unwrap_or_else(|| panic!("no expert counters: {line}"));
    let nums: Vec<u64> = part
        .split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().unwrap())
        .collect();
    [nums[0], nums[1], nums[2]]
}

#[test]
fn requests_that_share_steps_share_their_expert_counters() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--parallel", "2"]);
    let url = s.url("/v1/chat/completions");
    let ids: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = ["Tell me about the sea", "Write a short poem"]
            .iter()
            .map(|p| {
                let url = url.clone();
                sc.spawn(move || post_json(&url, &long_chat(p, 30, false)))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                let (st, v) = h.join().unwrap();
                assert_eq!(st, 200, "{v}");
                let id = v["id"].as_str().unwrap();
                id.trim_start_matches("chatcmpl-").to_string()
            })
            .collect()
    });
    let (st, m) = get(&s.url("/metrics"), None);
    assert_eq!(st, 200);
    let total = |name: &str| -> u64 { metric(&m, name) };
    let steps = total("k3_batch_size_count");
    let alone = total("k3_batch_size_bucket{le=\"1\"}");
    assert!(steps > alone, "the two never shared a step: {m}");
    // The server writes a request's line before its answer, but the test reads the log
    // through a pipe that may lag behind.
    for id in &ids {
        assert!(
            s.wait_log(&format!("serve {id}: prompt"), 10),
            "{}",
            s.log()
        );
    }
    let log = s.log();
    let [a, b] = [expert_counts(&log, &ids[0]), expert_counts(&log, &ids[1])];
    assert!(a[0] > 0 && b[0] > 0, "{a:?} {b:?}\n{log}");
    assert_eq!(a[0] + b[0], total("k3_expert_lookups_total"), "{m}\n{log}");
    assert_eq!(a[2] + b[2], total("k3_streamed_bytes_total"), "{m}\n{log}");
}
