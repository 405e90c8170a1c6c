//! Stored responses of the Responses API (`store: true`, the default): what `GET
//! /v1/responses/{id}` returns, what `input_items` lists, and the conversation a later
//! request's `previous_response_id` continues.
//!
//! Kept in memory within a bound of bytes and of entries; past either, the least recently used
//! response is evicted (a later `previous_response_id` naming it is a 404). Each stored
//! response holds its whole conversation, so a chain never has to be walked and evicting an
//! earlier response never breaks a later one. Nothing survives a restart.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;

use crate::api::Message;

/// One stored response.
#[derive(Debug)]
pub struct StoredResponse {
    /// The response object, as `GET /v1/responses/{id}` returns it.
    pub response: Value,
    /// This request's input items, each with its id (`input_items`).
    pub input_items: Vec<Value>,
    /// The conversation through this response's output, without its `instructions` (they do
    /// not carry over to a request that continues it).
    pub conversation: Vec<Message>,
}

impl StoredResponse {
    /// About the bytes it holds.
    fn bytes(&self) -> usize {
        let json = |v: &Value| v.to_string().len();
        let message = |m: &Message| {
            m.text_bytes()
                + m.tool_calls
                    .iter()
                    .flatten()
                    .map(|c| {
                        c.function.name.len() + c.function.arguments.as_ref().map_or(0, String::len)
                    })
                    .sum::<usize>()
                + 64
        };
        json(&self.response)
            + self.input_items.iter().map(json).sum::<usize>()
            + self.conversation.iter().map(message).sum::<usize>()
    }
}

struct Entry {
    stored: Arc<StoredResponse>,
    /// Its place in the use order.
    tick: u64,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Ids by last use, oldest first.
    order: BTreeMap<u64, String>,
    bytes: usize,
    tick: u64,
}

/// The stored responses.
pub struct ResponseStore {
    inner: Mutex<Inner>,
    max_bytes: usize,
    max_entries: usize,
}

impl ResponseStore {
    /// A store of at most `max_bytes` (about) and `max_entries` responses.
    pub fn new(max_bytes: usize, max_entries: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            max_bytes,
            max_entries,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The response `id`, marked as just used.
    pub fn get(&self, id: &str) -> Option<Arc<StoredResponse>> {
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        let entry = inner.entries.get_mut(id)?;
        let old = std::mem::replace(&mut entry.tick, tick);
        let stored = entry.stored.clone();
        inner.order.remove(&old);
        inner.order.insert(tick, id.to_string());
        Some(stored)
    }

    /// Stores `stored` as `id`, evicting the least recently used responses past the bounds.
    /// Returns false when it alone is larger than the whole store (it is not kept).
    pub fn put(&self, id: String, stored: StoredResponse) -> bool {
        let bytes = stored.bytes();
        if bytes > self.max_bytes || self.max_entries == 0 {
            return false;
        }
        let mut inner = self.lock();
        remove(&mut inner, &id);
        while inner.bytes + bytes > self.max_bytes || inner.entries.len() >= self.max_entries {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            if let Some(entry) = inner.entries.remove(&oldest) {
                inner.bytes -= entry.bytes;
            }
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.order.insert(tick, id.clone());
        inner.bytes += bytes;
        inner.entries.insert(
            id,
            Entry {
                stored: Arc::new(stored),
                tick,
                bytes,
            },
        );
        true
    }

    /// Deletes the response `id`; false when there was none.
    pub fn delete(&self, id: &str) -> bool {
        remove(&mut self.lock(), id)
    }

    /// Responses and bytes held.
    #[cfg(test)]
    fn usage(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.entries.len(), inner.bytes)
    }
}

fn remove(inner: &mut Inner, id: &str) -> bool {
    match inner.entries.remove(id) {
        Some(entry) => {
            inner.order.remove(&entry.tick);
            inner.bytes -= entry.bytes;
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn stored(text: &str) -> StoredResponse {
        StoredResponse {
            response: json!({"text": text}),
            input_items: Vec::new(),
            conversation: Vec::new(),
        }
    }

    #[test]
    fn the_least_recently_used_response_goes_first() {
        let store = ResponseStore::new(usize::MAX, 2);
        assert!(store.put("a".into(), stored("a")));
        assert!(store.put("b".into(), stored("b")));
        assert!(store.get("a").is_some());
        assert!(store.put("c".into(), stored("c")));
        assert!(store.get("b").is_none(), "b was used least recently");
        assert!(store.get("a").is_some() && store.get("c").is_some());
        assert!(store.delete("a"));
        assert!(!store.delete("a"));
        assert_eq!(store.usage().0, 1);
    }

    #[test]
    fn the_byte_bound_holds_and_a_response_larger_than_the_store_is_not_kept() {
        let one = stored(&"x".repeat(100)).bytes();
        let store = ResponseStore::new(one * 3, 100);
        for i in 0..10 {
            assert!(store.put(format!("r{i}"), stored(&"x".repeat(100))));
            assert!(store.usage().1 <= one * 3);
        }
        assert_eq!(store.usage().0, 3);
        assert!(store.get("r9").is_some() && store.get("r6").is_none());
        assert!(!store.put("big".into(), stored(&"x".repeat(one * 4))));
        assert!(store.get("big").is_none());
    }
}
