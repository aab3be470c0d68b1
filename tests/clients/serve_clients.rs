//! Real clients against `k3 serve`: the official `openai` and `anthropic` Python clients
//! (a chat, a tool loop, the Responses API's answers and tool loop) and a headless Chromium
//! loading the web page. Where a client is missing the test passes and the run says so in
//! one line naming what installs it (`support::skip_group`), except under CI=true, where a
//! missing client fails it.

use crate::serve_support;
use crate::support;

use serde_json::{json, Value};
use serve_support::Server;
use std::path::Path;
use std::process::Command;

/// The Python client tests cannot run here for `why`: said once, or a failure under CI=true.
fn no_python_clients(why: &str) {
    support::skip_group(
        "the Python client tests",
        why,
        "python3 with pip install openai anthropic jsonschema",
    );
}

/// The browser tests cannot run here: said once, or a failure under CI=true.
fn no_browser() {
    support::skip_group(
        "the browser tests",
        "no chromium, chromium-browser or google-chrome to run the page in",
        "apt-get install chromium",
    );
}

/// Runs `tests/serve_clients/SCRIPT BASE_URL MODEL` against a fresh server on the tiny
/// model: whether it succeeded, its stdout and stderr, and the server's log. None when
/// python3 cannot start ([`no_python_clients`]) or the script's client module is missing
/// (exit 3: `missing` says so with the script's message).
fn run_python_client(
    script: &str,
    missing: &dyn Fn(&str),
) -> Option<(bool, String, String, String)> {
    run_python_client_with(script, &[], missing)
}

/// [`run_python_client`] against a server started with `flags`.
fn run_python_client_with(
    script: &str,
    flags: &[&str],
    missing: &dyn Fn(&str),
) -> Option<(bool, String, String, String)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/serve_clients")
        .join(script);
    let dir = support::tiny(0);
    let s = Server::start(&dir, flags);
    let model = dir.file_name().unwrap().to_str().unwrap();
    let o = match Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}", s.addr))
        .arg(model)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            no_python_clients(&format!("python3 cannot start: {e}"));
            return None;
        }
    };
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    if o.status.code() == Some(3) {
        missing(out.trim());
        return None;
    }
    Some((o.status.success(), out, err, s.log()))
}

#[test]
fn the_openai_python_client_chats_streams_and_reads_errors() {
    let Some((ok, out, err, log)) = run_python_client("openai_client.py", &no_python_clients)
    else {
        return;
    };
    assert!(ok, "{out}\n{err}\nserver log:\n{log}");
    assert!(out.contains("openai client: ok"), "{out}");
}

#[test]
fn a_tool_loop_through_the_openai_and_anthropic_clients_loses_no_text() {
    let Some((ok, out, err, log)) = run_python_client("tool_loop.py", &no_python_clients) else {
        return;
    };
    assert!(ok, "{out}\n{err}\nserver log:\n{log}");
    assert!(out.contains("tool loop: ok"), "{out}");
}

#[test]
fn the_openai_python_client_speaks_the_responses_api() {
    let Some((ok, out, err, log)) = run_python_client("responses_client.py", &no_python_clients)
    else {
        return;
    };
    assert!(ok, "{out}\n{err}\nserver log:\n{log}");
    assert!(out.contains("responses client: ok"), "{out}");
}

#[test]
fn concurrent_openai_and_anthropic_clients_get_their_replies_alone_and_one_may_leave() {
    let flags = ["--parallel", "4", "--max-tokens", "65536"];
    let Some((ok, out, err, log)) =
        run_python_client_with("concurrent_clients.py", &flags, &no_python_clients)
    else {
        return;
    };
    assert!(ok, "{out}\n{err}\nserver log:\n{log}");
    assert!(out.contains("concurrent clients: ok"), "{out}");
    // The stream that left was cancelled, not run to its 20000 tokens.
    assert!(log.contains("(cancelled)"), "{log}");
}

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

/// A headless Chromium driven over `--remote-debugging-pipe` (DevTools protocol messages,
/// each ended by a NUL byte, on file descriptors 3 and 4), so the test waits for the page
/// itself to say it is done instead of guessing a time budget.
struct Browser {
    child: std::process::Child,
    to: std::fs::File,
    from: std::io::BufReader<std::fs::File>,
    next: u64,
}

impl Browser {
    fn start(binary: &str, profile: &Path) -> Browser {
        use std::os::fd::FromRawFd;
        use std::os::unix::process::CommandExt;
        let mut to_chrome = [0i32; 2];
        let mut from_chrome = [0i32; 2];
        // SAFETY: pipe(2) writes two descriptors into each two-element array.
        unsafe {
            assert_eq!(libc::pipe(to_chrome.as_mut_ptr()), 0);
            assert_eq!(libc::pipe(from_chrome.as_mut_ptr()), 0);
        }
        let (child_in, child_out) = (to_chrome[0], from_chrome[1]);
        let mut cmd = Command::new(binary);
        cmd.args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--remote-debugging-pipe",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
        // SAFETY: between fork and exec only dup2(2) runs, which is async-signal-safe; it
        // puts the pipe ends where --remote-debugging-pipe expects them (3 in, 4 out).
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(child_in, 3) < 0 || libc::dup2(child_out, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("starting the browser");
        // SAFETY: the parent's ends are open descriptors owned by nothing else; the
        // child's ends are closed here once the child holds its copies.
        unsafe {
            libc::close(child_in);
            libc::close(child_out);
            Browser {
                child,
                to: std::fs::File::from_raw_fd(to_chrome[1]),
                from: std::io::BufReader::new(std::fs::File::from_raw_fd(from_chrome[0])),
                next: 1,
            }
        }
    }

    /// Sends one command (to a page's session when given) and returns its result.
    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        use std::io::{BufRead, Write};
        let id = self.next;
        self.next += 1;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(0);
        self.to.write_all(&bytes).unwrap();
        loop {
            let mut buf = Vec::new();
            let n = self.from.read_until(0, &mut buf).unwrap();
            assert!(n > 0, "the browser closed its pipe");
            buf.pop();
            let v: Value = serde_json::from_slice(&buf).unwrap();
            if v["id"] == json!(id) {
                assert!(v["error"].is_null(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    fn eval(&mut self, session: &str, expr: &str) -> Value {
        let r = self.call(
            Some(session),
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true}),
        );
        r["result"]["value"].clone()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_web_page_streams_an_answer_in_a_headless_browser() {
    let Some(binary) = chromium() else {
        return no_browser();
    };
    let dir = support::tiny(0);
    let s = Server::start(&dir, &[]);
    let profile = tempfile::tempdir().unwrap();
    let mut b = Browser::start(binary, profile.path());
    let target = b.call(
        None,
        "Target.createTarget",
        json!({"url": s.url("/?autotest=Hello")}),
    );
    let attached = b.call(
        None,
        "Target.attachToTarget",
        json!({"targetId": target["targetId"], "flatten": true}),
    );
    let session = attached["sessionId"].as_str().unwrap().to_string();
    let t = std::time::Instant::now();
    let status = "(document.getElementById('status') || {}).textContent";
    while b.eval(&session, status) != json!("done") {
        assert!(
            t.elapsed().as_secs() < 60,
            "the page never finished: {}",
            s.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let dom = b
        .eval(&session, "document.documentElement.outerHTML")
        .as_str()
        .unwrap()
        .to_string();
    // The page sent the message and shows the stream's end with the answer's stats.
    assert!(
        dom.contains("<div class=\"turn user\">Hello</div>"),
        "{dom}"
    );
    let stats = b.eval(&session, "document.querySelector('.stats').textContent");
    assert!(stats.as_str().is_some_and(|t| t.contains("tok/s")), "{dom}");
    assert!(!dom.contains("class=\"error\""), "{dom}");
    // The live chart has the engine's figures of the last tokens.
    let points = b.eval(&session, "chart.points.length");
    assert!(points.as_u64().is_some_and(|n| n >= 1), "{points}\n{dom}");
    let legend = b.eval(&session, "document.getElementById('legend').textContent");
    let legend = legend.as_str().unwrap_or("");
    assert!(
        legend.contains("tok/s ") && legend.contains("expert hit ") && legend.contains("GB/s"),
        "{legend}"
    );
    // What it shows is what the server streamed: the greedy answer to the same turn.
    let (st, v) = serve_support::post_json(
        &s.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(st, 200, "{v}");
    let answer = b.eval(&session, "document.querySelector('.answer').textContent");
    assert_eq!(answer, v["choices"][0]["message"]["content"], "{dom}");
    let _ = b.call(None, "Browser.close", json!({}));
}

/// Waits until the page's status reads `done`.
fn wait_done(b: &mut Browser, session: &str, s: &Server) {
    let t = std::time::Instant::now();
    let status = "(document.getElementById('status') || {}).textContent";
    while b.eval(session, status) != json!("done") {
        assert!(
            t.elapsed().as_secs() < 60,
            "the page never finished: {}",
            s.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn the_web_page_answers_chats_from_two_tabs_at_once() {
    let Some(binary) = chromium() else {
        return no_browser();
    };
    let dir = support::tiny(0);
    // Small prefill slices: each tab's long prompt takes many steps, so the two overlap.
    let s = Server::start(&dir, &["--parallel", "4", "--prefill-slice", "16"]);
    let profile = tempfile::tempdir().unwrap();
    let mut b = Browser::start(binary, profile.path());
    let tabs: Vec<String> = (0..2)
        .map(|_| {
            let target = b.call(None, "Target.createTarget", json!({"url": s.url("/")}));
            let attached = b.call(
                None,
                "Target.attachToTarget",
                json!({"targetId": target["targetId"], "flatten": true}),
            );
            attached["sessionId"].as_str().unwrap().to_string()
        })
        .collect();
    for tab in &tabs {
        let t = std::time::Instant::now();
        while b.eval(tab, "typeof send") != json!("function") {
            assert!(t.elapsed().as_secs() < 30, "the page never loaded");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    let prompts = [
        format!("{}Tell me about the sea", "word ".repeat(800)),
        format!("{}Write a short poem", "note ".repeat(800)),
    ];
    for (tab, p) in tabs.iter().zip(&prompts) {
        b.eval(
            tab,
            &format!(
                "send({}, {{temperature: 0, maxTokens: 12, thinking: false}}); true",
                json!(p)
            ),
        );
    }
    for (tab, p) in tabs.iter().zip(&prompts) {
        wait_done(&mut b, tab, &s);
        let dom = b
            .eval(tab, "document.documentElement.outerHTML")
            .as_str()
            .unwrap()
            .to_string();
        assert!(!dom.contains("class=\"error\""), "{dom}");
        assert_eq!(b.eval(tab, "history.length"), json!(2), "{dom}");
        // Each tab shows the greedy answer its own turn gets alone.
        let (st, v) = serve_support::post_json(
            &s.url("/v1/chat/completions"),
            &json!({"messages": [{"role": "user", "content": p}], "max_tokens": 12,
                    "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}}),
        );
        assert_eq!(st, 200, "{v}");
        let answer = b.eval(tab, "document.querySelector('.answer').textContent");
        assert_eq!(answer, v["choices"][0]["message"]["content"], "{dom}");
        let stats = b.eval(tab, "document.querySelector('.stats').textContent");
        assert!(stats.as_str().is_some_and(|t| t.contains("tok/s")), "{dom}");
    }
    // The two tabs' requests ran together: steps of more than one sequence.
    let (st, m) = serve_support::get(&s.url("/metrics"), None);
    assert_eq!(st, 200);
    let count = |name: &str| -> f64 { serve_support::metric(&m, name) };
    assert!(
        count("k3_batch_size_count") > count("k3_batch_size_bucket{le=\"1\"}"),
        "the two tabs never shared a step: {m}"
    );
    let _ = b.call(None, "Browser.close", json!({}));
}

#[test]
fn the_web_page_does_not_resend_a_failed_turn_and_shows_thinking_as_it_streams() {
    let Some(binary) = chromium() else {
        return no_browser();
    };
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--api-key", "k3y"]);
    let profile = tempfile::tempdir().unwrap();
    let mut b = Browser::start(binary, profile.path());
    // Without the key the turn fails (401): it is shown as failed and left out of the history.
    let target = b.call(
        None,
        "Target.createTarget",
        json!({"url": s.url("/?autotest=First")}),
    );
    let attached = b.call(
        None,
        "Target.attachToTarget",
        json!({"targetId": target["targetId"], "flatten": true}),
    );
    let session = attached["sessionId"].as_str().unwrap().to_string();
    wait_done(&mut b, &session, &s);
    assert_eq!(b.eval(&session, "history.length"), json!(0));
    assert_eq!(
        b.eval(
            &session,
            "document.querySelectorAll('.turn.failed .error').length"
        ),
        json!(1)
    );
    // With the key, a thinking turn: the think section is open while it streams.
    b.eval(
        &session,
        "document.getElementById('key').value = 'k3y'; window.seenOpen = false; \
         new MutationObserver(() => { for (const d of document.querySelectorAll('details')) \
           if (d.open && d.textContent.length > 'thinking'.length) window.seenOpen = true; }) \
           .observe(document.getElementById('log'), {subtree: true, childList: true, \
             characterData: true, attributes: true}); \
         send('Second', {temperature: 0, maxTokens: 12, thinking: true}); true",
    );
    wait_done(&mut b, &session, &s);
    assert_eq!(b.eval(&session, "history.length"), json!(2));
    assert_eq!(b.eval(&session, "history[0].content"), json!("Second"));
    assert_eq!(b.eval(&session, "window.seenOpen"), json!(true));
    // Once the turn ends the thinking is collapsed, and can be opened again.
    assert_eq!(
        b.eval(
            &session,
            "[...document.querySelectorAll('details')].pop().open"
        ),
        json!(false)
    );
    let _ = b.call(None, "Browser.close", json!({}));
}

/// The coding-agent CLI tests cannot run here for `why`: said once, or a failure under
/// CI=true.
fn no_agent_clis(why: &str) {
    support::skip_group(
        "the coding-agent CLI tests",
        why,
        "npm install -g @anthropic-ai/claude-code @openai/codex",
    );
}

/// An agent CLI on PATH that answers `--version`.
fn agent_cli(name: &str) -> Option<String> {
    Command::new(name)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// Runs `cmd` to its end or until `secs` pass (then kills it): its exit status (None when
/// killed), stdout and stderr.
fn run_for(mut cmd: Command, secs: u64) -> (Option<i32>, String, String) {
    use std::io::Read;
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting the client");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    (status, o.join().unwrap(), e.join().unwrap())
}

/// The server's per-request lines (`[K3] serve N: prompt P (cached C) | ... | ttft T | ...`):
/// printed so a CI log shows what each client's turn cost.
fn answered(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.starts_with("[K3] serve ") && l.contains(": prompt "))
        .collect()
}

/// Each answered request's prompt tokens and TTFT from the server's lines, as
/// `prompt 1234 tokens (cached 0), ttft 1.234s`, one a request.
fn prompt_sizes_and_ttft(log: &str) -> Vec<String> {
    answered(log)
        .iter()
        .map(|l| {
            let field = |name: &str| {
                l.split(name)
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .unwrap_or("?")
                    .to_string()
            };
            format!(
                "prompt {} tokens (cached {}, ttft {}",
                field(": prompt "),
                field("(cached ").trim_end_matches(')'),
                field("| ttft ")
            ) + ")"
        })
        .collect()
}

#[test]
fn claude_code_completes_a_turn_against_the_demo() {
    let Some(version) = agent_cli("claude") else {
        return no_agent_clis("no `claude` (Claude Code) on PATH");
    };
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--max-answer", "16"]);
    let model = dir.file_name().unwrap().to_str().unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("claude");
    cmd.args([
        "-p",
        "Say hi.",
        "--output-format",
        "json",
        "--max-turns",
        "1",
    ])
    .args(["--model", model])
    .current_dir(home.path())
    .env("HOME", home.path())
    .env("ANTHROPIC_BASE_URL", format!("http://{}", s.addr))
    .env("ANTHROPIC_API_KEY", "dummy")
    .env_remove("ANTHROPIC_AUTH_TOKEN")
    .env("DISABLE_TELEMETRY", "1")
    .env("DISABLE_AUTOUPDATER", "1")
    .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    // Its side requests (titles, summaries) name the small model: the same server's.
    for v in [
        "ANTHROPIC_SMALL_FAST_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
    ] {
        cmd.env(v, model);
    }
    let (status, out, err) = run_for(cmd, 600);
    let log = s.log();
    eprintln!(
        "claude {version}: {}\n  {}",
        prompt_sizes_and_ttft(&log).join("; "),
        answered(&log).join("\n  ")
    );
    assert_eq!(status, Some(0), "{out}\n{err}\nserver log:\n{log}");
    let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["is_error"], false, "{v}\nserver log:\n{log}");
    assert!(!answered(&log).is_empty(), "no request answered:\n{log}");
}

#[test]
fn codex_exec_completes_a_turn_against_the_demo() {
    let Some(version) = agent_cli("codex") else {
        return no_agent_clis("no `codex` (Codex CLI) on PATH");
    };
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--max-answer", "32"]);
    let model = dir.file_name().unwrap().to_str().unwrap();
    let home = tempfile::tempdir().unwrap();
    std::fs::write(
        home.path().join("config.toml"),
        format!(
            "model = \"{model}\"\nmodel_provider = \"k3\"\nweb_search = \"disabled\"\n\n\
             [model_providers.k3]\nname = \"k3\"\n\
             base_url = \"http://{}/v1\"\nwire_api = \"responses\"\nenv_key = \"K3_TEST_KEY\"\n",
            s.addr
        ),
    )
    .unwrap();
    let mut cmd = Command::new("codex");
    cmd.args([
        "exec",
        "--skip-git-repo-check",
        "--color",
        "never",
        "Say hi.",
    ])
    .current_dir(home.path())
    .env("HOME", home.path())
    .env("CODEX_HOME", home.path())
    .env("K3_TEST_KEY", "dummy");
    let (status, out, err) = run_for(cmd, 600);
    let log = s.log();
    eprintln!(
        "codex {version}: {}\n  {}",
        prompt_sizes_and_ttft(&log).join("; "),
        answered(&log).join("\n  ")
    );
    assert!(
        status.is_some(),
        "codex did not finish:\n{out}\n{err}\nserver log:\n{log}"
    );
    assert!(!answered(&log).is_empty(), "no request answered:\n{log}");
    // The random demo model writes until its budget ends, so Codex reads the stream to
    // its end and reports the turn incomplete (it exits 1 for that); a turn the model
    // ends itself exits 0. Anything else (a refused request, a stream it cannot parse)
    // fails.
    let incomplete =
        format!("{out}{err}").contains("Incomplete response returned, reason: max_output_tokens");
    assert!(
        status == Some(0) || incomplete,
        "{out}\n{err}\nserver log:\n{log}"
    );
    assert!(!log.contains("refused POST"), "{log}");
}

#[test]
fn the_openai_agents_sdk_runs_a_forced_tool_loop_over_responses() {
    let Some((ok, out, err, log)) = run_python_client("agents_tool_loop.py", &|why| {
        support::skip_group(
            "the OpenAI Agents SDK test",
            why,
            "pip install openai-agents",
        )
    }) else {
        return;
    };
    assert!(ok, "{out}\n{err}\nserver log:\n{log}");
    assert!(out.contains("agents tool loop: ok"), "{out}");
}
