//! The responses kept for `previous_response_id` and `GET /v1/responses/{id}`, bounded in
//! count and bytes.

use super::*;

/// Responses the store keeps at most; the oldest goes first.
pub(crate) const MAX_STORED_RESPONSES: usize = 256;

/// Bytes of stored responses and conversations the store keeps at most (their JSON).
pub(crate) const MAX_STORED_BYTES: usize = 64 << 20;

/// Ids of `store: false` responses remembered, so a later reference gets the reason.
const MAX_UNSTORED_IDS: usize = 4096;

/// A stored response: the object `GET` returns and the conversation it ended.
struct Kept {
    response: Value,
    conversation: Vec<Value>,
    bytes: usize,
}

#[derive(Default)]
struct StoreInner {
    kept: HashMap<String, Kept>,
    order: VecDeque<String>,
    bytes: usize,
    unstored: VecDeque<String>,
}

/// The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: at most
/// [`MAX_STORED_RESPONSES`] and [`MAX_STORED_BYTES`], in memory, the oldest dropped first.
/// Ids carry a number drawn at start, so an id from another run of the server is unknown
/// here rather than naming some other response.
pub struct ResponseStore {
    nonce: u64,
    inner: Mutex<StoreInner>,
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a response id names nothing held.
fn not_held(id: &str, unstored: bool) -> String {
    if unstored {
        format!("response {id:?} was made with store: false, so nothing of it was kept; send the conversation in `input` instead")
    } else {
        format!("response {id:?} is not held by this server: deleted, dropped (it keeps the last {MAX_STORED_RESPONSES} responses, {} MiB at most), or never made here", MAX_STORED_BYTES >> 20)
    }
}

impl ResponseStore {
    /// An empty store with a fresh id number.
    pub fn new() -> Self {
        Self {
            nonce: rand::random(),
            inner: Mutex::new(StoreInner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreInner> {
        // A panic while holding the lock leaves the maps consistent: each step is one
        // insert or remove.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The response id for engine job `job`.
    pub fn response_id(&self, job: &str) -> String {
        format!("resp_{:016x}_{job}", self.nonce)
    }

    /// Keeps a finished response and the conversation it ended; one larger than the
    /// whole store is not kept.
    pub fn put(&self, response: Value, conversation: Vec<Value>) {
        let Some(id) = response["id"].as_str().map(str::to_string) else {
            return;
        };
        let bytes = response.to_string().len()
            + conversation
                .iter()
                .map(|m| m.to_string().len())
                .sum::<usize>();
        if bytes > MAX_STORED_BYTES {
            tracing::warn!("[K3] serve: response {id} is {bytes} bytes, more than the store holds ({MAX_STORED_BYTES}): not kept");
            return;
        }
        let mut s = self.lock();
        while s.order.len() >= MAX_STORED_RESPONSES || s.bytes + bytes > MAX_STORED_BYTES {
            let Some(old) = s.order.pop_front() else {
                break;
            };
            if let Some(k) = s.kept.remove(&old) {
                s.bytes -= k.bytes;
            }
        }
        s.order.push_back(id.clone());
        s.bytes += bytes;
        s.kept.insert(
            id,
            Kept {
                response,
                conversation,
                bytes,
            },
        );
    }

    /// Remembers that response `id` was made with `store: false`.
    pub fn put_unstored(&self, id: &str) {
        let mut s = self.lock();
        if s.unstored.len() >= MAX_UNSTORED_IDS {
            s.unstored.pop_front();
        }
        s.unstored.push_back(id.to_string());
    }

    /// The conversation response `id` ended, its answer included; a 400 naming
    /// `previous_response_id` when it is not held.
    pub fn conversation(&self, id: &str) -> R<Vec<Value>> {
        let s = self.lock();
        match s.kept.get(id) {
            Some(k) => Ok(k.conversation.clone()),
            None => Err(field_is(
                "previous_response_id",
                not_held(id, s.unstored.iter().any(|u| u == id)),
            )),
        }
    }

    /// The stored response object, or the 404.
    pub fn get(&self, id: &str) -> R<Value> {
        let s = self.lock();
        match s.kept.get(id) {
            Some(k) => Ok(k.response.clone()),
            None => Err(ApiError::status(
                404,
                not_held(id, s.unstored.iter().any(|u| u == id)),
            )),
        }
    }

    /// Forgets response `id`, or the 404.
    pub fn delete(&self, id: &str) -> R<()> {
        let mut s = self.lock();
        match s.kept.remove(id) {
            Some(k) => {
                s.bytes -= k.bytes;
                s.order.retain(|o| o != id);
                Ok(())
            }
            None => {
                let unstored = s.unstored.iter().any(|u| u == id);
                Err(ApiError::status(404, not_held(id, unstored)))
            }
        }
    }
}
