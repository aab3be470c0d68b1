//! The sampling and limit fields every route reads (OpenAI's and Anthropic's alike), checked
//! against the server's limits and turned into [`GenParams`].

use super::api_error::ApiError;
use super::request::{GenParams, Limits, MAX_CHOICES, R};
use crate::sampling::SamplerConfig;
use serde_json::Value;

/// The sampling and limit fields every route reads, as sent.
#[derive(Default)]
pub(crate) struct SamplingFields {
    /// `temperature`
    pub temperature: Option<f64>,
    /// `top_p`
    pub top_p: Option<f64>,
    /// `top_k`
    pub top_k: Option<u64>,
    /// `min_p`
    pub min_p: Option<f64>,
    /// `repetition_penalty` or `repeat_penalty` (the first names it)
    pub repetition_penalty: Option<(&'static str, f64)>,
    /// `seed`
    pub seed: Option<serde_json::Number>,
    /// `presence_penalty`
    pub presence_penalty: Option<f64>,
    /// `frequency_penalty`
    pub frequency_penalty: Option<f64>,
    /// The token limit and the field that gave it.
    pub max_tokens: Option<(&'static str, u64)>,
    /// Stop strings, already split, with the field name.
    pub stop: (&'static str, Vec<String>),
    /// `stream`
    pub stream: Option<bool>,
    /// `stream_options.include_usage`
    pub include_usage: Option<bool>,
    /// `ignore_eos`
    pub ignore_eos: Option<bool>,
    /// `n`
    pub n: Option<u64>,
    /// `model`
    pub model: Option<String>,
}

fn in_range(field: &str, x: f64, lo: f64, hi: f64) -> R<f32> {
    if !x.is_finite() || x < lo || x > hi {
        return Err(ApiError::field(
            field,
            format!("{x} is outside [{lo}, {hi}]"),
        ));
    }
    Ok(x as f32)
}

/// A seed for a request that names none: each request samples its own stream.
pub(crate) fn random_seed() -> u64 {
    rand::random()
}

impl SamplingFields {
    /// Checks the fields against `limits` and builds the parameters on `base`.
    pub(crate) fn params(self, limits: &Limits, base: &SamplerConfig) -> R<GenParams> {
        let mut s = *base;
        if let Some(t) = self.temperature {
            s.temperature = in_range("temperature", t, 0.0, 100.0)?;
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::field("top_p", format!("{p} is outside (0, 1]")));
            }
            s.top_p = p as f32;
        }
        if let Some(k) = self.top_k {
            s.top_k = usize::try_from(k).unwrap_or(usize::MAX);
        }
        if let Some(p) = self.min_p {
            s.min_p = in_range("min_p", p, 0.0, 1.0)?;
        }
        if let Some((field, r)) = self.repetition_penalty {
            if !(r > 0.0 && r <= 100.0) {
                return Err(ApiError::field(field, format!("{r} is outside (0, 100]")));
            }
            s.repetition_penalty = r as f32;
        }
        let seed_given = self.seed.is_some();
        s.seed = match &self.seed {
            Some(n) => n
                .as_u64()
                .or_else(|| n.as_i64().map(|i| i as u64))
                .ok_or_else(|| ApiError::field("seed", "must be a whole number"))?,
            None => random_seed(),
        };
        let penalty = |field: &str, v: Option<f64>| -> R<f32> {
            v.map(|p| in_range(field, p, -2.0, 2.0))
                .transpose()
                .map(|p| p.unwrap_or(0.0))
        };
        s.presence_penalty = penalty("presence_penalty", self.presence_penalty)?;
        s.frequency_penalty = penalty("frequency_penalty", self.frequency_penalty)?;
        let max_tokens = match self.max_tokens {
            Some((field, n)) => {
                if n == 0 || n > limits.max_tokens as u64 {
                    return Err(ApiError::field(
                        field,
                        format!("{n} is outside 1..={}", limits.max_tokens),
                    ));
                }
                n as usize
            }
            None => limits.default_max_tokens,
        };
        let (stop_field, stop) = self.stop;
        if stop.len() > limits.max_stop {
            return Err(ApiError::field(
                stop_field,
                format!("{} stop strings, at most {}", stop.len(), limits.max_stop),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::field(
                stop_field,
                "stop strings must not be empty",
            ));
        }
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::field(
                    "n",
                    format!("{n} is outside 1..={MAX_CHOICES} (this server's limit)"),
                ))
            }
        };
        Ok(GenParams {
            model: self.model,
            sampling: s,
            seed_given,
            max_tokens,
            think_budget: None,
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: self.include_usage.unwrap_or(false),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            n,
            logprobs: None,
            constraint: None,
            snapshot_at: None,
            boundaries: Vec::new(),
        })
    }
}

/// `stop`: a string or an array of strings.
pub(super) fn stop_strings(v: Option<Value>) -> R<Vec<String>> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(a)) => a
            .into_iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s),
                v => Err(type_error(&format!("stop[{i}]"), "a string", &v)),
            })
            .collect(),
        Some(v) => Err(type_error("stop", "a string or an array of strings", &v)),
    }
}

/// The 400 for `field` holding a JSON value of the wrong kind.
pub(super) fn type_error(field: &str, want: &str, got: &Value) -> ApiError {
    let kind = crate::json_kind::json_kind(got);
    ApiError::field(field, format!("must be {want}, got {kind}"))
}
