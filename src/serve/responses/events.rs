//! The outcome of a `/v1/responses` request as the API shapes it: the `response` object and
//! its typed stream of events, both built by [`ResponseEvents`] so the two agree.

use super::*;

/// What one output item holds.
#[derive(Clone, Debug)]
enum ItemBody {
    Reasoning(String),
    Message(String),
    Call {
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// One output item of a response.
#[derive(Clone, Debug)]
struct OutItem {
    id: String,
    body: ItemBody,
    status: &'static str,
}

/// The output items and events of one response, built from the engine's events: a
/// reasoning or message item opens when its kind of text starts, tool calls follow at the
/// end. The whole answer of a request that does not stream is built the same way.
pub(crate) struct ResponseEvents {
    id: String,
    model: String,
    created_at: u64,
    echo: Map<String, Value>,
    summary: bool,
    namespaces: HashMap<String, String>,
    items: Vec<OutItem>,
    open: bool,
    seq: u64,
    finished: Option<Value>,
    pub(super) failed: Option<String>,
}

impl ResponseEvents {
    /// The events of response `id`; `summary` reports think text as the reasoning summary,
    /// `namespaces` names the namespace of each function declared in one.
    pub(crate) fn new(
        id: &str,
        model: &str,
        echo: Map<String, Value>,
        summary: bool,
        namespaces: HashMap<String, String>,
    ) -> Self {
        Self {
            id: id.to_string(),
            model: model.to_string(),
            created_at: now_secs(),
            echo,
            summary,
            namespaces,
            items: Vec::new(),
            open: false,
            seq: 0,
            finished: None,
            failed: None,
        }
    }

    fn event(&mut self, kind: &'static str, mut data: Value) -> SseFrame {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        SseFrame::named(kind, data.to_string())
    }

    /// The id's tail that item ids are built on.
    fn base(&self) -> &str {
        self.id.strip_prefix("resp_").unwrap_or(&self.id)
    }

    fn item_json(&self, item: &OutItem, whole: bool) -> Value {
        match &item.body {
            ItemBody::Reasoning(text) => {
                let part = |kind: &str| {
                    if whole {
                        json!([{"type": kind, "text": text}])
                    } else {
                        json!([])
                    }
                };
                let mut v = json!({"id": item.id, "type": "reasoning", "status": item.status});
                if self.summary {
                    v["summary"] = part("summary_text");
                } else {
                    v["summary"] = json!([]);
                    v["content"] = part("reasoning_text");
                }
                v
            }
            ItemBody::Message(text) => {
                let content = if whole {
                    json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
                } else {
                    json!([])
                };
                json!({"id": item.id, "type": "message", "status": item.status,
                       "role": "assistant", "content": content})
            }
            ItemBody::Call {
                call_id,
                name,
                arguments,
            } => {
                let mut v = json!({"id": item.id, "type": "function_call", "status": item.status,
                                   "call_id": call_id, "name": name,
                                   "arguments": if whole { arguments.as_str() } else { "" }});
                if let Some(ns) = self.namespaces.get(name) {
                    v["namespace"] = json!(ns);
                }
                v
            }
        }
    }

    /// The `response` object in its present state.
    fn response(&self, status: &str, o: Option<&Outcome>, error: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": null,
            "model": self.model,
            "output": self.items.iter().map(|i| self.item_json(i, true)).collect::<Vec<_>>(),
            "usage": null,
        });
        if let Value::Object(m) = &mut v {
            for (k, e) in &self.echo {
                m.insert(k.clone(), e.clone());
            }
        }
        if status == "incomplete" {
            v["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        if let Some(o) = o {
            v["completed_at"] = json!(now_secs());
            v["usage"] = usage(o);
        }
        v
    }

    /// `response.created` and `response.in_progress`.
    pub(crate) fn start(&mut self) -> Vec<SseFrame> {
        let r = self.response("in_progress", None, None);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn open_item(&mut self, body: ItemBody, out: &mut Vec<SseFrame>) {
        let index = self.items.len();
        let prefix = match body {
            ItemBody::Reasoning(_) => "rs",
            ItemBody::Message(_) => "msg",
            ItemBody::Call { .. } => "fc",
        };
        let item = OutItem {
            id: format!("{prefix}_{}_{index}", self.base()),
            body,
            status: "in_progress",
        };
        let added = self.item_json(&item, false);
        let id = item.id.clone();
        let kind = std::mem::discriminant(&item.body);
        self.items.push(item);
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        ));
        let at = json!({"item_id": id, "output_index": index});
        let with = |mut v: Value, k: &str, x: Value| {
            v[k] = x;
            v
        };
        if kind == std::mem::discriminant(&ItemBody::Message(String::new())) {
            let part =
                json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
            let d = with(with(at, "content_index", json!(0)), "part", part);
            out.push(self.event("response.content_part.added", d));
        } else if kind == std::mem::discriminant(&ItemBody::Reasoning(String::new())) {
            if self.summary {
                let part = json!({"type": "summary_text", "text": ""});
                let d = with(with(at, "summary_index", json!(0)), "part", part);
                out.push(self.event("response.reasoning_summary_part.added", d));
            } else {
                let part = json!({"type": "reasoning_text", "text": ""});
                let d = with(with(at, "content_index", json!(0)), "part", part);
                out.push(self.event("response.content_part.added", d));
            }
        }
        self.open = true;
    }

    /// Closes the open text item with `status`.
    fn close_item(&mut self, status: &'static str, out: &mut Vec<SseFrame>) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        let index = self.items.len() - 1;
        self.items[index].status = status;
        let item = self.items[index].clone();
        let at = |k: &str, v: Value| {
            let mut d = json!({"item_id": item.id, "output_index": index});
            d[k] = v;
            d
        };
        match &item.body {
            ItemBody::Message(text) => {
                let mut d = at("content_index", json!(0));
                d["text"] = json!(text);
                d["logprobs"] = json!([]);
                out.push(self.event("response.output_text.done", d));
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let mut d = at("content_index", json!(0));
                d["part"] = part;
                out.push(self.event("response.content_part.done", d));
            }
            ItemBody::Reasoning(text) if self.summary => {
                let mut d = at("summary_index", json!(0));
                d["text"] = json!(text);
                out.push(self.event("response.reasoning_summary_text.done", d));
                let mut d = at("summary_index", json!(0));
                d["part"] = json!({"type": "summary_text", "text": text});
                out.push(self.event("response.reasoning_summary_part.done", d));
            }
            ItemBody::Reasoning(text) => {
                let mut d = at("content_index", json!(0));
                d["text"] = json!(text);
                out.push(self.event("response.reasoning_text.done", d));
                let mut d = at("content_index", json!(0));
                d["part"] = json!({"type": "reasoning_text", "text": text});
                out.push(self.event("response.content_part.done", d));
            }
            ItemBody::Call { .. } => {}
        }
        let done = self.item_json(&item, true);
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        ));
    }

    fn text(&mut self, field: Field, text: String, out: &mut Vec<SseFrame>) {
        let same = self.open
            && matches!(
                (field, self.items.last().map(|i| &i.body)),
                (Field::Reasoning, Some(ItemBody::Reasoning(_)))
                    | (Field::Content, Some(ItemBody::Message(_)))
            );
        if !same {
            self.close_item("completed", out);
            let body = match field {
                Field::Reasoning => ItemBody::Reasoning(String::new()),
                Field::Content => ItemBody::Message(String::new()),
            };
            self.open_item(body, out);
        }
        let index = self.items.len() - 1;
        let item_id = self.items[index].id.clone();
        let d = json!({"item_id": item_id, "output_index": index});
        let (kind, d) = match &mut self.items[index].body {
            ItemBody::Message(t) => {
                t.push_str(&text);
                let mut d = d;
                d["content_index"] = json!(0);
                d["delta"] = json!(text);
                d["logprobs"] = json!([]);
                ("response.output_text.delta", d)
            }
            ItemBody::Reasoning(t) => {
                t.push_str(&text);
                let mut d = d;
                let (k, idx) = if self.summary {
                    ("response.reasoning_summary_text.delta", "summary_index")
                } else {
                    ("response.reasoning_text.delta", "content_index")
                };
                d[idx] = json!(0);
                d["delta"] = json!(text);
                (k, d)
            }
            ItemBody::Call { .. } => return,
        };
        out.push(self.event(kind, d));
    }

    /// Frames for one engine event, and whether the stream ended.
    pub(crate) fn frame(&mut self, ev: Event) -> (Vec<SseFrame>, bool) {
        let mut out = Vec::new();
        match ev {
            Event::Delta(Delta { text, field, .. }) => {
                if !text.is_empty() {
                    self.text(field, text, &mut out);
                }
                (out, false)
            }
            Event::Done(o) => {
                let c = o.first();
                let incomplete = c.finish == FinishReason::Length;
                let last_status = if incomplete {
                    "incomplete"
                } else {
                    "completed"
                };
                let has_message = self
                    .items
                    .iter()
                    .any(|i| matches!(i.body, ItemBody::Message(_)));
                if !has_message && c.tool_calls.is_empty() {
                    self.close_item("completed", &mut out);
                    self.open_item(ItemBody::Message(String::new()), &mut out);
                }
                self.close_item(
                    if c.tool_calls.is_empty() {
                        last_status
                    } else {
                        "completed"
                    },
                    &mut out,
                );
                for (k, call) in c.tool_calls.iter().enumerate() {
                    let call_id = format!("call_{}_{k}", self.base());
                    let body = ItemBody::Call {
                        call_id,
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                    };
                    self.open_item(body, &mut out);
                    self.open = false;
                    let index = self.items.len() - 1;
                    self.items[index].status = "completed";
                    let item_id = self.items[index].id.clone();
                    out.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": index, "delta": call.arguments}),
                    ));
                    out.push(self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": item_id, "output_index": index, "name": call.name,
                               "arguments": call.arguments}),
                    ));
                    let done = self.item_json(&self.items[index], true);
                    out.push(self.event(
                        "response.output_item.done",
                        json!({"output_index": index, "item": done}),
                    ));
                }
                let status = if incomplete {
                    "incomplete"
                } else {
                    "completed"
                };
                let r = self.response(status, Some(&o), None);
                let kind = if incomplete {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                out.push(self.event(kind, json!({"response": r})));
                self.finished = Some(r);
                (out, true)
            }
            Event::Failed(m) => {
                self.close_item("incomplete", &mut out);
                let error = json!({"code": "server_error", "message": m});
                let r = self.response("failed", None, Some(error));
                out.push(self.event("response.failed", json!({"response": r})));
                self.failed = Some(m);
                (out, true)
            }
        }
    }

    /// The finished `response` object, once the engine's `Done` came.
    pub(crate) fn finished(&self) -> Option<&Value> {
        self.finished.as_ref()
    }

    /// The answer as a chat message (thinking, text and calls with their call ids), for
    /// the stored conversation.
    pub(crate) fn assistant_message(&self) -> Value {
        let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
        for i in &self.items {
            match &i.body {
                ItemBody::Reasoning(t) => reasoning.push_str(t),
                ItemBody::Message(t) => content.push_str(t),
                ItemBody::Call {
                    call_id,
                    name,
                    arguments,
                } => calls.push(json!({"id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": arguments}})),
            }
        }
        let mut m = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            m["reasoning_content"] = json!(reasoning);
        }
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        m
    }
}

/// `usage` in the Responses shape.
fn usage(o: &Outcome) -> Value {
    let reasoning: usize = o.choices.iter().map(|c| c.reasoning_tokens).sum();
    json!({
        "input_tokens": o.prompt_tokens,
        "input_tokens_details": {"cached_tokens": o.cached_tokens},
        "output_tokens": o.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": o.prompt_tokens + o.completion_tokens,
    })
}
