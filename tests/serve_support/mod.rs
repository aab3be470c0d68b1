//! A `k3 serve` process on the tiny model and an ephemeral port, and an HTTP client for it.

#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running server; killed when dropped.
pub(crate) struct Server {
    pub child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// Everything it wrote to stderr so far.
    pub log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `k3 serve DIR --port 0 --backend cpu --quiet EXTRA...` and waits for its address.
    /// The prompt cache is off unless EXTRA names its directory: servers of different tests
    /// must not load each other's prompts from the user's cache directory.
    pub(crate) fn start(dir: &std::path::Path, extra: &[&str]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_k3"));
        cmd.env_remove("K3_PROMPT_CACHE");
        if extra.contains(&"--prompt-cache") {
            cmd.env_remove("K3_NO_PROMPT_CACHE");
        } else {
            cmd.env("K3_NO_PROMPT_CACHE", "1");
        }
        let mut child = cmd
            .arg("serve")
            .arg(dir)
            .args(["--port", "0", "--backend", "cpu", "--quiet"])
            .args(extra)
            .env("RAYON_NUM_THREADS", "2")
            .env_remove("K3_EXPERT_GB")
            .env_remove("K3_THINK")
            .env_remove("K3_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting k3 serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stderr).lines();
            let mut tx = Some(tx);
            while let Some(Ok(line)) = lines.next() {
                if let Some(at) = line.find("listening on http://") {
                    let rest = &line[at + "listening on http://".len()..];
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr);
                    }
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no address from k3 serve: {}", log.lock().unwrap()));
        Server { child, addr, log }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub(crate) fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the log has a line containing `needle`.
    pub(crate) fn wait_log(&self, needle: &str, secs: u64) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(secs) {
            if self.log().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An agent that reports error statuses as responses.
pub(crate) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// POSTs a JSON body; returns (status, headers' Retry-After, body as JSON or a string).
pub(crate) fn post(url: &str, body: &str, key: Option<&str>) -> (u16, Option<String>, Value) {
    let mut req = agent().post(url).header("Content-Type", "application/json");
    if let Some(k) = key {
        req = req.header("Authorization", &format!("Bearer {k}"));
    }
    let mut resp = req.send(body).expect("POST");
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, retry, v)
}

pub(crate) fn post_json(url: &str, body: &Value) -> (u16, Value) {
    let (s, _, v) = post(url, &body.to_string(), None);
    (s, v)
}

/// The value of the `/metrics` line that starts with `name` (a bucket with its labels, or a
/// bare counter), parsed; panics naming it when there is none.
pub(crate) fn metric<T: std::str::FromStr>(metrics: &str, name: &str) -> T {
    metrics
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("no {name}: {metrics}"))
}

pub(crate) fn get(url: &str, key: Option<&str>) -> (u16, String) {
    let mut req = agent().get(url);
    if let Some(k) = key {
        req = req.header("Authorization", &format!("Bearer {k}"));
    }
    let mut resp = req.call().expect("GET");
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap_or_default())
}

/// A streamed answer: the `data:` payloads in order (`[DONE]` included as a string).
pub(crate) fn post_stream(url: &str, body: &Value) -> (u16, Vec<Value>) {
    let resp = agent()
        .post(url)
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .expect("POST");
    let status = resp.status().as_u16();
    let mut reader = BufReader::new(resp.into_body().into_reader());
    let mut out = Vec::new();
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 0 {
        if let Some(d) = line.trim_end().strip_prefix("data: ") {
            out.push(serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_string())));
        }
        line.clear();
    }
    (status, out)
}

/// Opens a streamed request and returns its body reader (drop it to disconnect).
pub(crate) fn open_stream(url: &str, body: &Value) -> Box<dyn Read> {
    let resp = agent()
        .post(url)
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .expect("POST");
    Box::new(resp.into_body().into_reader())
}

/// Joins a streamed chat answer's deltas: (reasoning, content, finish_reason, usage).
pub(crate) fn join_chat(chunks: &[Value]) -> (String, String, String, Option<Value>) {
    let (mut r, mut c, mut f, mut u) = (String::new(), String::new(), String::new(), None);
    for ch in chunks {
        if let Some(choice) = ch["choices"].get(0) {
            if let Some(t) = choice["delta"]["reasoning_content"].as_str() {
                r.push_str(t);
            }
            if let Some(t) = choice["delta"]["content"].as_str() {
                c.push_str(t);
            }
            if let Some(t) = choice["finish_reason"].as_str() {
                f = t.to_string();
            }
        }
        if !ch["usage"].is_null() {
            u = Some(ch["usage"].clone());
        }
    }
    (r, c, f, u)
}
