//! The cost of a response read from its body: the tokens an LLM API reports as its usage (configuration
//! `cost.settle.usage`), found chunk by chunk as the body passes (`proxy_on_response_body`), in bounded memory.
//!
//! Two shapes of body, as the response's content type says:
//!
//! - JSON: the three APIs write the usage as one of the last members of the response object, so only the
//!   body's last [`TAIL_BYTES`] are kept, and at its end the last `"usage": {...}` (Gemini:
//!   `"usageMetadata"`) in them that has token fields is parsed. A JSON string escapes its quotes, so the
//!   key's bytes in a model's text (`\"usage\"`) never match.
//! - Server-sent events (`text/event-stream`): lines end with LF, CR LF or CR; each `data:` line holds one
//!   JSON event (none of the three APIs splits one over several `data:` lines), and a line is parsed only when
//!   the usage key (a path's last key) stands in it as an object member. Each token field keeps the latest
//!   value any event reported: Anthropic sends its input tokens in `message_start` and its output tokens in
//!   each `message_delta`, and a stream cut short keeps what it reported ([`UsageMeter::so_far`]).
//!
//! Where each API puts the usage (read 2026 from the providers' references; the numbers in a stream are
//! cumulative, so the latest replaces, never adds):
//!
//! - OpenAI chat completions (<https://platform.openai.com/docs/api-reference/chat/object>): `usage` with
//!   `prompt_tokens`, `completion_tokens` and `total_tokens` ("prompt + completion"). Streamed, only when the
//!   request sets `stream_options.include_usage`
//!   (<https://platform.openai.com/docs/api-reference/chat/create#chat-create-stream_options>): "an additional
//!   chunk will be streamed before the `data: [DONE]` message", with `choices` empty; "all other chunks will
//!   also include a `usage` field, but with a null value", and a stream interrupted may never send it.
//! - OpenAI responses (<https://platform.openai.com/docs/api-reference/responses/object>): `usage` with
//!   `input_tokens`, `output_tokens` and `total_tokens`; streamed
//!   (<https://developers.openai.com/api/reference/resources/responses/streaming-events>), the
//!   `response.completed` event's `response.usage` (`response.created` has `"usage": null`).
//! - Anthropic messages (<https://docs.anthropic.com/en/api/messages>): `usage` with `input_tokens`,
//!   `output_tokens` and, with prompt caching, `cache_creation_input_tokens` and `cache_read_input_tokens`:
//!   `input_tokens` is only the prompt after the last cache breakpoint, and the whole prompt is the sum of
//!   the three (<https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching>, "Tracking cache
//!   performance"). Streamed (<https://docs.anthropic.com/en/docs/build-with-claude/streaming>):
//!   `message_start` carries `message.usage` (the input tokens, and an early `output_tokens`), each
//!   `message_delta` a `usage` whose counts are cumulative (the last one's `output_tokens` is the total).
//! - Gemini generateContent (<https://ai.google.dev/api/generate-content#UsageMetadata>): `usageMetadata`
//!   with `totalTokenCount`, the sum of `promptTokenCount` (cached content included), `candidatesTokenCount`,
//!   `toolUsePromptTokenCount` and `thoughtsTokenCount` (Vertex AI's reference says so of the same message:
//!   <https://cloud.google.com/vertex-ai/generative-ai/docs/reference/rest/v1/GenerateContentResponse>).
//!   `streamGenerateContent?alt=sse` sends a `GenerateContentResponse` per event, each with `usageMetadata`
//!   as counted so far (Vertex AI's early ones hold only `trafficType`); the last is the final count. Without
//!   `alt=sse` the stream is one JSON array of them, read as a JSON body: its last usage is the final one.

use alloc::collections::VecDeque;
use serde_json::Value;

use crate::prelude::*;

/// The bytes kept of a JSON body (its end) and of one event-stream line: 16 KiB.
///
/// Why the end is enough: the usage is one of the last members of each API's response object (OpenAI
/// chat completions: before `service_tier` and `system_fingerprint`; OpenAI responses: before `user` and
/// `metadata`, at most 16 short pairs; Anthropic: last; Gemini: before `modelVersion` and `responseId`), and
/// of each event (an event is such an object, or wraps one as its last member: `response`, `message`).
/// The consequence: a usage object that starts more than 16 KiB before the end of its body or line is not
/// seen, and the response reports no cost (`None`; an OpenAI response whose `metadata` echoes 16 values of
/// 512 characters escaped as `\uXXXX` would be one). A line up to this long is parsed whole (a
/// [`UsageFormat::Paths`] path is then followed from the root); a longer `data:` line (a Gemini image in its
/// event) is searched from its end as a large body is, and a longer line of another field is dropped.
pub const TAIL_BYTES: usize = 16 * 1024;

/// How many members with the usage key are tried in one body or line, last first, before giving up: the
/// key can also name a member of the content (a property in a tool's JSON schema that an OpenAI response
/// echoes before its usage), but the real usage comes after it; the bound keeps a body made of such keys
/// from costing a parse of the whole tail for each.
const CANDIDATES: usize = 4;

/// Where a response reports its usage (configuration `cost.settle.usage`), and how its cost adds up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsageFormat {
    /// OpenAI chat completions and responses: `usage.total_tokens`, else the sum of `prompt_tokens` and
    /// `completion_tokens` (chat) or of `input_tokens` and `output_tokens` (responses). Streamed: the chat
    /// chunk whose `usage` is not null (only with `stream_options.include_usage`), the responses'
    /// `response.completed` event.
    OpenAi,
    /// Anthropic messages: the sum of `usage.input_tokens`, `cache_creation_input_tokens`,
    /// `cache_read_input_tokens` and `output_tokens`. The cached prompt counts, as it does in OpenAI's
    /// `prompt_tokens` and Gemini's `promptTokenCount` (Anthropic's own input-tokens-per-minute limit leaves
    /// cache reads out: [`UsageFormat::Paths`] naming the other fields does the same). Streamed:
    /// `message_start`'s `message.usage`, then each `message_delta`'s `usage`.
    Anthropic,
    /// Gemini generateContent: `usageMetadata.totalTokenCount`, else the sum of `promptTokenCount`,
    /// `candidatesTokenCount`, `thoughtsTokenCount` and `toolUsePromptTokenCount`. Streamed: the last event's.
    Gemini,
    /// The sum of the whole numbers at these paths (`["usage", "total_tokens"]`, configured as
    /// `usage.total_tokens`). Streamed: each path's latest number in any event. A JSON body or event line
    /// longer than [`TAIL_BYTES`] has only its end kept: there a path is matched by its last two keys (the
    /// last `"usage": {...}` in the tail with a number at `total_tokens`), its outer keys unchecked.
    Paths(Vec<Vec<String>>),
}

/// What a token field of a built-in format counts ([`Weights`] price each kind; without weights a
/// response costs its total, or the sum of every kind but [`Kind::CachedWithinInput`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The whole count (OpenAI `total_tokens`, Gemini `totalTokenCount`): used alone when present and
    /// the response is not weighted.
    Total,
    /// Prompt tokens (OpenAI's and Gemini's include the cached ones).
    Input,
    /// The cached part of the [`Kind::Input`] tokens (OpenAI `prompt_tokens_details.cached_tokens`, Gemini
    /// `cachedContentTokenCount`): not added again.
    CachedWithinInput,
    /// Cached prompt tokens counted apart from the input (Anthropic `cache_read_input_tokens`).
    CachedInput,
    /// Prompt tokens written to the cache (Anthropic `cache_creation_input_tokens`).
    CacheWrite,
    /// Generated tokens, reasoning included.
    Output,
}

/// A built-in format: the key of its usage object and its token fields (a dotted name is a member of a
/// member), each with what it counts.
struct Builtin {
    key: &'static str,
    fields: &'static [(&'static str, Kind)],
}

const OPENAI: Builtin = Builtin {
    key: "usage",
    fields: &[
        ("total_tokens", Kind::Total),
        ("prompt_tokens", Kind::Input),
        ("completion_tokens", Kind::Output),
        ("input_tokens", Kind::Input),
        ("output_tokens", Kind::Output),
        ("prompt_tokens_details.cached_tokens", Kind::CachedWithinInput),
        ("input_tokens_details.cached_tokens", Kind::CachedWithinInput),
    ],
};

const ANTHROPIC: Builtin = Builtin {
    key: "usage",
    fields: &[
        ("input_tokens", Kind::Input),
        ("cache_creation_input_tokens", Kind::CacheWrite),
        ("cache_read_input_tokens", Kind::CachedInput),
        ("output_tokens", Kind::Output),
    ],
};

const GEMINI: Builtin = Builtin {
    key: "usageMetadata",
    fields: &[
        ("totalTokenCount", Kind::Total),
        ("promptTokenCount", Kind::Input),
        ("candidatesTokenCount", Kind::Output),
        ("thoughtsTokenCount", Kind::Output),
        ("toolUsePromptTokenCount", Kind::Input),
        ("cachedContentTokenCount", Kind::CachedWithinInput),
    ],
};

/// Prices of the token kinds of a built-in format (configuration `cost.settle.weights`), in thousandths
/// of a permit per token: a response costs `ceil(input x uncached input + cached_input x cached input +
/// cache_write x cache writes + output x output tokens)` permits, as LLM APIs price them (e.g. output at 4x
/// the input, cached input at 0.1x). A response that reports only a total is charged at the highest of
/// the four weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Weights {
    /// Prompt tokens not read from a cache, thousandths of a permit each.
    pub input: u32,
    /// Prompt tokens read from a cache (OpenAI `cached_tokens`, Anthropic `cache_read_input_tokens`,
    /// Gemini `cachedContentTokenCount`), thousandths.
    pub cached_input: u32,
    /// Prompt tokens written to a cache (Anthropic `cache_creation_input_tokens`), thousandths.
    pub cache_write: u32,
    /// Generated tokens (reasoning included), thousandths.
    pub output: u32,
}

impl UsageFormat {
    fn builtin(&self) -> Option<&'static Builtin> {
        match self {
            UsageFormat::OpenAi => Some(&OPENAI),
            UsageFormat::Anthropic => Some(&ANTHROPIC),
            UsageFormat::Gemini => Some(&GEMINI),
            UsageFormat::Paths(_) => None,
        }
    }
}

/// One response's usage, read from its body as it passes: [`UsageMeter::feed`] each chunk, then
/// [`UsageMeter::finish`] at the end of the body, or [`UsageMeter::so_far`] when it never ends. Holds at
/// most [`TAIL_BYTES`] of the body (plus a number per token field); nothing it is fed can make it panic.
#[derive(Debug)]
pub struct UsageMeter {
    reading: Reading,
    /// JSON: the body's last bytes. Event stream: the current line, so far (its last bytes when longer).
    tail: Tail,
    event_stream: bool,
    /// The current line is longer than [`TAIL_BYTES`] and not a `data:` line: dropped up to its end.
    skip_line: bool,
}

/// The format, and the latest number of each of its fields (built-in: [`Builtin::fields`]; paths: each path).
#[derive(Debug)]
struct Reading {
    format: UsageFormat,
    values: Vec<Option<u64>>,
    /// Prices per token kind (built-in formats only): the cost is weighted instead of the total.
    weights: Option<Weights>,
}

/// The last [`TAIL_BYTES`] of what was pushed (a ring, so dropping the front copies nothing).
#[derive(Debug, Default)]
struct Tail {
    bytes: VecDeque<u8>,
    /// Bytes were dropped from the front.
    cut: bool,
}

impl UsageMeter {
    /// A meter for one response. `event_stream`: the response is `text/event-stream` (server-sent events),
    /// else a JSON body.
    pub fn new(format: &UsageFormat, event_stream: bool) -> Self {
        let fields = match format {
            UsageFormat::Paths(paths) => paths.len(),
            builtin => builtin.builtin().map_or(0, |b| b.fields.len()),
        };
        UsageMeter {
            reading: Reading { format: format.clone(), values: vec![None; fields], weights: None },
            tail: Tail::default(),
            event_stream,
            skip_line: false,
        }
    }

    /// The same meter pricing each token kind with `weights` (a built-in format's; [`UsageFormat::Paths`]
    /// ignores them: the configuration refuses that pair).
    #[must_use]
    pub fn weighted(mut self, weights: Option<Weights>) -> Self {
        self.reading.weights = weights;
        self
    }

    /// Reads the body's next chunk (split anywhere: inside a line, a UTF-8 sequence, a number).
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.event_stream {
            self.tail.push(chunk);
            return;
        }
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|&byte| byte == b'\n' || byte == b'\r') {
            self.line(rest.get(..end).unwrap_or_default(), true);
            rest = rest.get(end + 1..).unwrap_or_default();
        }
        if !rest.is_empty() {
            self.line(rest, false);
        }
    }

    /// At the end of the body: its cost in tokens, or `None` when it reported none (no usage, or none that
    /// parses). Frees the buffers; calling it again gives the same.
    pub fn finish(&mut self) -> Option<u64> {
        if self.event_stream {
            // The last line, when the body does not end with a line break.
            self.line(&[], true);
        } else {
            let whole = !self.tail.cut;
            self.reading.read(self.tail.bytes.make_contiguous(), whole);
        }
        self.tail = Tail::default();
        self.reading.total()
    }

    /// For a response that never completes (client gone, upstream reset): the cost its stream reported so
    /// far, from the latest number of each field (Anthropic: `message_start`'s input tokens plus the last
    /// `message_delta`'s output tokens). A JSON body reports nothing before its end: `None`.
    pub fn so_far(&self) -> Option<u64> {
        if self.event_stream {
            self.reading.total()
        } else {
            None
        }
    }

    /// A piece of the current event-stream line; `ends`: the line ends after it.
    fn line(&mut self, piece: &[u8], ends: bool) {
        if ends && self.tail.bytes.is_empty() && !self.skip_line {
            // The whole line is in this chunk: read in place, nothing copied.
            self.reading.line(piece);
            return;
        }
        if !self.skip_line {
            let over = self.tail.bytes.len() + piece.len() > TAIL_BYTES;
            if over && !self.tail.cut && !is_data(self.tail.bytes.iter().chain(piece)) {
                self.skip_line = true;
                self.tail.clear();
            } else {
                self.tail.push(piece);
            }
        }
        if ends {
            if !self.skip_line {
                let whole = !self.tail.cut;
                let line = self.tail.bytes.make_contiguous();
                if whole {
                    self.reading.line(line);
                } else {
                    self.reading.read(line, false);
                }
            }
            self.tail.clear();
            self.skip_line = false;
        }
    }
}

/// Whether a line (its first bytes) is a `data:` field.
fn is_data<'a>(line: impl Iterator<Item = &'a u8>) -> bool {
    line.take(5).eq(b"data:")
}

impl Tail {
    /// Appends `data`, dropping from the front what goes past [`TAIL_BYTES`]; the ring grows to that at most.
    fn push(&mut self, data: &[u8]) {
        let keep = data.len().min(TAIL_BYTES);
        let over = (self.bytes.len() + keep).saturating_sub(TAIL_BYTES);
        self.cut |= keep < data.len() || over > 0;
        let data = data.get(data.len() - keep..).unwrap_or_default();
        self.bytes.drain(..over.min(self.bytes.len()));
        let needed = self.bytes.len() + data.len();
        if needed > self.bytes.capacity() {
            let capacity = needed.max(self.bytes.capacity() * 2).min(TAIL_BYTES);
            self.bytes.reserve_exact(capacity - self.bytes.len());
        }
        self.bytes.extend(data);
    }

    fn clear(&mut self) {
        self.bytes.clear();
        self.cut = false;
    }
}

impl Reading {
    /// A whole event-stream line: its `data:` value read if it is one (the line's end only, when long).
    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        if line.len() > TAIL_BYTES {
            self.read(line.get(line.len() - TAIL_BYTES..).unwrap_or_default(), false);
        } else {
            self.read(data.strip_prefix(b" ").unwrap_or(data), true);
        }
    }

    /// Takes the usage `text` reports: a whole JSON value (`whole`) or the end of one. Fields it has replace
    /// the numbers kept; fields it lacks keep theirs.
    fn read(&mut self, text: &[u8], whole: bool) {
        match &self.format {
            UsageFormat::Paths(paths) => {
                let mentioned =
                    paths.iter().any(|path| path.last().is_some_and(|leaf| member(text, leaf, text.len()).is_some()));
                let root = if whole && mentioned { serde_json::from_slice::<Value>(text).ok() } else { None };
                for (value, path) in self.values.iter_mut().zip(paths) {
                    let found = match &root {
                        Some(root) => number_at(root, path),
                        None if whole || !mentioned => None,
                        None => path_in_tail(text, path),
                    };
                    if found.is_some() {
                        *value = found;
                    }
                }
            }
            builtin => {
                let Some(builtin) = builtin.builtin() else { return };
                let has_field = |usage: &Value| builtin.fields.iter().any(|(field, _)| count(usage, field).is_some());
                if let Some(usage) = last_member(text, builtin.key, &has_field) {
                    for (value, (field, _)) in self.values.iter_mut().zip(builtin.fields) {
                        if let Some(number) = count(&usage, field) {
                            *value = Some(number);
                        }
                    }
                }
            }
        }
    }

    /// The cost from the numbers kept: `None` when there are none.
    fn total(&self) -> Option<u64> {
        let Some(builtin) = self.format.builtin() else { return sum(&self.values) };
        let mut kinds = [None::<u64>; 6];
        for ((_, kind), value) in builtin.fields.iter().zip(&self.values) {
            if let (Some(value), Some(slot)) = (value, kinds.get_mut(*kind as usize)) {
                *slot = Some(slot.unwrap_or(0).saturating_add(*value));
            }
        }
        let [total, input, within, cached, write, output] = kinds;
        if kinds.iter().all(Option::is_none) {
            return None;
        }
        let Some(weights) = self.weights else {
            return total.or_else(|| sum(&[input, cached, write, output]));
        };
        let parts = [input, within, cached, write, output];
        if parts.iter().all(Option::is_none) {
            let highest = weights.input.max(weights.cached_input).max(weights.cache_write).max(weights.output);
            return Some(priced(&[(total.unwrap_or(0), highest)]));
        }
        let within = within.unwrap_or(0);
        Some(priced(&[
            (input.unwrap_or(0).saturating_sub(within), weights.input),
            (within.saturating_add(cached.unwrap_or(0)), weights.cached_input),
            (write.unwrap_or(0), weights.cache_write),
            (output.unwrap_or(0), weights.output),
        ]))
    }
}

/// `ceil(sum of tokens x thousandths / 1000)`, saturating (at `u64::MAX / 1000` permits: no budget is that big).
fn priced(parts: &[(u64, u32)]) -> u64 {
    let thousandths =
        parts.iter().fold(0u64, |sum, &(tokens, weight)| sum.saturating_add(tokens.saturating_mul(u64::from(weight))));
    thousandths.div_ceil(1000)
}

fn sum(values: &[Option<u64>]) -> Option<u64> {
    values.iter().flatten().copied().reduce(u64::saturating_add)
}

/// The whole number of `field` in the object `usage`, a dotted name following members (a count above
/// `u64::MAX`, negative or fractional is none).
fn count(usage: &Value, field: &str) -> Option<u64> {
    field.split('.').try_fold(usage, |value, key| value.get(key))?.as_u64()
}

/// The whole number at `path` from `root`.
fn number_at(root: &Value, path: &[String]) -> Option<u64> {
    path.iter().try_fold(root, |value, key| value.get(key.as_str()))?.as_u64()
}

/// A path's number in the end of a JSON text: the value of its last key inside the last object under its
/// next-to-last key that has it (a one-key path: the last member with that key and a number).
fn path_in_tail(text: &[u8], path: &[String]) -> Option<u64> {
    let (anchor, rest) = match path {
        [.., parent, leaf] => (parent, core::slice::from_ref(leaf)),
        [leaf] => (leaf, &[][..]),
        [] => return None,
    };
    let found = last_member(text, anchor, &|value: &Value| number_at(value, rest).is_some())?;
    number_at(&found, rest)
}

/// The value of the last member `"key": ...` in `text` (of the last [`CANDIDATES`]) that parses and that
/// `accept`s. Only what follows the key is parsed, so `text` may begin anywhere, inside a string or a value.
fn last_member(text: &[u8], key: &str, accept: &dyn Fn(&Value) -> bool) -> Option<Value> {
    let mut end = text.len();
    for _ in 0..CANDIDATES {
        let (start, value) = member(text, key, end)?;
        end = start;
        let mut values = serde_json::Deserializer::from_slice(value).into_iter::<Value>();
        if let Some(Ok(value)) = values.next() {
            if accept(&value) {
                return Some(value);
            }
        }
    }
    None
}

/// The last `"key"` followed by a colon that ends before `end` in `text`: where its quote starts, and the
/// text from its value on.
fn member<'t>(text: &'t [u8], key: &str, end: usize) -> Option<(usize, &'t [u8])> {
    let key = key.as_bytes();
    let mut end = end.min(text.len());
    loop {
        // Quote by quote from the right (a byte compare each: this runs on every body byte in the guest),
        // the last `"key"` closing before `end` that is followed by `:`.
        let close = text.get(..end)?.iter().rposition(|&byte| byte == b'"')?;
        if let Some(start) = close.checked_sub(key.len() + 1) {
            if text.get(start) == Some(&b'"') && text.get(start + 1..close) == Some(key) {
                let after = trim_json_space(text.get(close + 1..).unwrap_or_default());
                if let Some(value) = after.strip_prefix(b":") {
                    return Some((start, trim_json_space(value)));
                }
            }
        }
        // A string that is not the key, or not a key (`"usage",`): look further back.
        end = close;
    }
}

fn trim_json_space(text: &[u8]) -> &[u8] {
    let start = text.iter().position(|byte| !matches!(byte, b' ' | b'\t' | b'\n' | b'\r')).unwrap_or(text.len());
    text.get(start..).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

    use super::*;

    // Sample bodies, shaped as the providers' references show them (numbers and texts our own). The texts
    // carry non-ASCII characters (splits inside a UTF-8 sequence) and, escaped in strings, the usage keys.

    const OPENAI_CHAT: &str = r#"{
  "id": "chatcmpl-AbC123",
  "object": "chat.completion",
  "created": 1741569952,
  "model": "gpt-4.1-2025-04-14",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "Café crème — the reply quotes {\"usage\": {\"total_tokens\": 999}} verbatim.",
        "refusal": null,
        "annotations": []
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 19,
    "completion_tokens": 10,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
  },
  "service_tier": "default",
  "system_fingerprint": "fp_2f5c7e1b"
}
"#;

    const OPENAI_CHAT_STREAM: &str = concat!(
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",",
        "\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},",
        "\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",",
        "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Grüß dich, \\\"usage\\\": {\\\"total_tokens\\\": 5}\"},",
        "\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",",
        "\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",",
        "\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21,",
        "\"prompt_tokens_details\":{\"cached_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0}}}\n\n",
        "data: [DONE]\n\n",
    );

    const OPENAI_RESPONSE: &str = concat!(
        "{\"id\":\"resp_67ccd2bed1ec8190\",\"object\":\"response\",\"created_at\":1741476542,\"status\":\"completed\",",
        "\"error\":null,\"incomplete_details\":null,\"instructions\":null,\"max_output_tokens\":null,",
        "\"model\":\"gpt-4.1-2025-04-14\",\"output\":[{\"type\":\"message\",\"id\":\"msg_67ccd2bf\",",
        "\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",",
        "\"text\":\"Once upon a time, a unicorn named Lumière…\",\"annotations\":[]}]}],",
        "\"parallel_tool_calls\":true,\"previous_response_id\":null,\"reasoning\":{\"effort\":null,\"summary\":null},",
        "\"store\":true,\"temperature\":1.0,\"text\":{\"format\":{\"type\":\"text\"}},\"tool_choice\":\"auto\",",
        "\"tools\":[{\"type\":\"function\",\"name\":\"report\",\"parameters\":{\"type\":\"object\",",
        "\"properties\":{\"usage\":{\"type\":\"string\"}}}}],\"top_p\":1.0,\"truncation\":\"disabled\",",
        "\"usage\":{\"input_tokens\":36,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":87,",
        "\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":123},\"user\":null,\"metadata\":{}}",
    );

    const OPENAI_RESPONSE_STREAM: &str = concat!(
        "event: response.created\n",
        "data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",",
        "\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null,\"metadata\":{}}}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":4,\"item_id\":\"msg_1\",",
        "\"output_index\":0,\"content_index\":0,\"delta\":\"Bonjour à tous\"}\n\n",
        "event: response.completed\n",
        "data: {\"type\":\"response.completed\",\"sequence_number\":9,\"response\":{\"id\":\"resp_1\",",
        "\"object\":\"response\",\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"role\":\"assistant\",",
        "\"content\":[{\"type\":\"output_text\",\"text\":\"Bonjour à tous\",\"annotations\":[]}]}],",
        "\"usage\":{\"input_tokens\":12,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":5,",
        "\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":17},\"user\":null,\"metadata\":{}}}\n\n",
    );

    const ANTHROPIC_MESSAGE: &str = concat!(
        "{\"id\":\"msg_013Zva2CMHLNnXjNJJKqJ2EF\",\"type\":\"message\",\"role\":\"assistant\",",
        "\"model\":\"claude-sonnet-4-5\",\"content\":[{\"type\":\"text\",\"text\":\"Hi! I'm Claude — \\\"usage\\\" ",
        "is just a word here.\"}],\"stop_reason\":\"end_turn\",\"stop_sequence\":null,",
        "\"usage\":{\"input_tokens\":2095,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":1800,",
        "\"output_tokens\":503,\"service_tier\":\"standard\"}}",
    );

    const ANTHROPIC_STREAM: &str = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY\",",
        "\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null,",
        "\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":100,",
        "\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n",
        "event: content_block_start\n",
        "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
        "event: ping\n",
        "data: {\"type\": \"ping\"}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello — ça va ?\"}}\n\n",
        "event: content_block_stop\n",
        "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},",
        "\"usage\":{\"output_tokens\":15}}\n\n",
        "event: message_stop\n",
        "data: {\"type\":\"message_stop\"}\n\n",
    );

    const GEMINI_RESPONSE: &str = concat!(
        "{\n  \"candidates\": [\n    {\n      \"content\": {\n        \"parts\": [{\"text\": \"Paris — la Ville Lumière.\"}],\n",
        "        \"role\": \"model\"\n      },\n      \"finishReason\": \"STOP\",\n      \"avgLogprobs\": -0.0421\n    }\n  ],\n",
        "  \"usageMetadata\": {\n    \"promptTokenCount\": 8,\n    \"candidatesTokenCount\": 412,\n",
        "    \"totalTokenCount\": 451,\n    \"promptTokensDetails\": [{\"modality\": \"TEXT\", \"tokenCount\": 8}],\n",
        "    \"thoughtsTokenCount\": 31\n  },\n  \"modelVersion\": \"gemini-2.5-flash\",\n",
        "  \"responseId\": \"mR2aaKuyC4-0nvgP3dq4kQw\"\n}\n",
    );

    // Gemini separates events with CR LF; Vertex AI's early events carry a usageMetadata without counts.
    const GEMINI_STREAM: &str = concat!(
        "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"The capital\"}],\"role\": \"model\"}}],",
        "\"usageMetadata\": {\"trafficType\": \"ON_DEMAND\"},\"modelVersion\": \"gemini-2.0-flash\"}\r\n\r\n",
        "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" of France\"}],\"role\": \"model\"}}],",
        "\"usageMetadata\": {\"promptTokenCount\": 11,\"totalTokenCount\": 11},\"modelVersion\": \"gemini-2.0-flash\"}\r\n\r\n",
        "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" is Paris (Île-de-France).\"}],\"role\": \"model\"},",
        "\"finishReason\": \"STOP\"}],\"usageMetadata\": {\"promptTokenCount\": 11,\"candidatesTokenCount\": 9,",
        "\"totalTokenCount\": 20,\"promptTokensDetails\": [{\"modality\": \"TEXT\",\"tokenCount\": 11}]},",
        "\"modelVersion\": \"gemini-2.0-flash\",\"responseId\": \"tTCwacuEBMvnitYP\"}\r\n\r\n",
    );

    /// `streamGenerateContent` without `alt=sse`: a JSON array of responses.
    const GEMINI_ARRAY: &str = concat!(
        "[{\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"Hé\"}],\"role\": \"model\"}}],",
        "\"usageMetadata\": {\"promptTokenCount\": 4,\"totalTokenCount\": 4}},\n",
        "{\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"llo\"}],\"role\": \"model\"},\"finishReason\": \"STOP\"}],",
        "\"usageMetadata\": {\"promptTokenCount\": 4,\"candidatesTokenCount\": 2,\"totalTokenCount\": 6}}]",
    );

    fn paths(list: &[&str]) -> UsageFormat {
        UsageFormat::Paths(list.iter().map(|path| path.split('.').map(String::from).collect()).collect())
    }

    /// Every sample: its format, whether it is an event stream, the body and its cost.
    fn samples() -> Vec<(UsageFormat, bool, &'static str, Option<u64>)> {
        vec![
            (UsageFormat::OpenAi, false, OPENAI_CHAT, Some(29)),
            (UsageFormat::OpenAi, true, OPENAI_CHAT_STREAM, Some(21)),
            (UsageFormat::OpenAi, false, OPENAI_RESPONSE, Some(123)),
            (UsageFormat::OpenAi, true, OPENAI_RESPONSE_STREAM, Some(17)),
            (UsageFormat::Anthropic, false, ANTHROPIC_MESSAGE, Some(2095 + 1800 + 503)),
            (UsageFormat::Anthropic, true, ANTHROPIC_STREAM, Some(25 + 100 + 15)),
            (UsageFormat::Gemini, false, GEMINI_RESPONSE, Some(451)),
            (UsageFormat::Gemini, true, GEMINI_STREAM, Some(20)),
            (UsageFormat::Gemini, false, GEMINI_ARRAY, Some(6)),
            (paths(&["usage.prompt_tokens", "usage.completion_tokens"]), false, OPENAI_CHAT, Some(29)),
            (paths(&["usage.total_tokens"]), true, OPENAI_CHAT_STREAM, Some(21)),
            (paths(&["message.usage.input_tokens", "usage.output_tokens"]), true, ANTHROPIC_STREAM, Some(40)),
            (paths(&["usageMetadata.candidatesTokenCount"]), false, GEMINI_RESPONSE, Some(412)),
        ]
    }

    fn read(format: &UsageFormat, event_stream: bool, chunks: &[&[u8]]) -> Option<u64> {
        let mut meter = UsageMeter::new(format, event_stream);
        for chunk in chunks {
            meter.feed(chunk);
        }
        meter.finish()
    }

    #[test]
    fn each_sample_gives_its_cost_whole_byte_by_byte_and_split_anywhere() {
        for (format, event_stream, body, cost) in samples() {
            let body = body.as_bytes();
            assert_eq!(read(&format, event_stream, &[body]), cost, "{format:?} whole");
            let bytes: Vec<&[u8]> = body.chunks(1).collect();
            assert_eq!(read(&format, event_stream, &bytes), cost, "{format:?} byte by byte");
            for split in 0..=body.len() {
                let (head, rest) = body.split_at(split);
                assert_eq!(read(&format, event_stream, &[head, rest]), cost, "{format:?} split at {split}");
            }
        }
    }

    /// Prices as `cost.settle.weights` gives them: input 1, cached input 0.1, cache writes 1.25, output 4.
    const PRICES: Weights = Weights { input: 1000, cached_input: 100, cache_write: 1250, output: 4000 };

    fn read_weighted(format: &UsageFormat, event_stream: bool, body: &str, weights: Weights) -> Option<u64> {
        let mut meter = UsageMeter::new(format, event_stream).weighted(Some(weights));
        for chunk in body.as_bytes().chunks(7) {
            meter.feed(chunk);
        }
        meter.finish()
    }

    #[test]
    fn weights_price_each_token_kind_and_round_up() {
        // OpenAI chat: 19 prompt (none cached) + 4 x 10 completion; the total (29) is not used.
        assert_eq!(read_weighted(&UsageFormat::OpenAi, false, OPENAI_CHAT, PRICES), Some(19 + 40));
        assert_eq!(read_weighted(&UsageFormat::OpenAi, true, OPENAI_CHAT_STREAM, PRICES), Some(9 + 48));
        assert_eq!(read_weighted(&UsageFormat::OpenAi, false, OPENAI_RESPONSE, PRICES), Some(36 + 4 * 87));
        assert_eq!(read_weighted(&UsageFormat::OpenAi, true, OPENAI_RESPONSE_STREAM, PRICES), Some(12 + 20));
        // Cached prompt tokens are part of OpenAI's prompt_tokens: 100 prompt of which 80 cached, 3 output:
        // 20 + 8 + 12.
        let cached = r#"{"usage":{"prompt_tokens":100,"completion_tokens":3,"total_tokens":103,
            "prompt_tokens_details":{"cached_tokens":80}}}"#;
        assert_eq!(read_weighted(&UsageFormat::OpenAi, false, cached, PRICES), Some(20 + 8 + 12));
        // Anthropic counts cache reads and writes apart: 2095 + 0.1 x 1800 + 4 x 503 = 4287.
        assert_eq!(read_weighted(&UsageFormat::Anthropic, false, ANTHROPIC_MESSAGE, PRICES), Some(2095 + 180 + 2012));
        // Streamed: 25 input, 100 written to the cache (x 1.25), 15 output (the last message_delta).
        assert_eq!(read_weighted(&UsageFormat::Anthropic, true, ANTHROPIC_STREAM, PRICES), Some(25 + 125 + 60));
        // Gemini: 8 prompt, 412 candidates + 31 thoughts as output.
        assert_eq!(read_weighted(&UsageFormat::Gemini, false, GEMINI_RESPONSE, PRICES), Some(8 + 4 * 443));
        let gemini_cached = r#"{"usageMetadata":{"promptTokenCount":50,"cachedContentTokenCount":40,
            "candidatesTokenCount":1,"totalTokenCount":51}}"#;
        assert_eq!(read_weighted(&UsageFormat::Gemini, false, gemini_cached, PRICES), Some(10 + 4 + 4));
        // Thousandths add up before rounding up: 3 x 0.1 = 0.3 -> 1 permit; 0 tokens cost 0.
        let few = r#"{"usage":{"input_tokens":0,"cache_read_input_tokens":3,"output_tokens":0}}"#;
        assert_eq!(read_weighted(&UsageFormat::Anthropic, false, few, PRICES), Some(1));
        let none = r#"{"usage":{"input_tokens":0,"output_tokens":0}}"#;
        assert_eq!(read_weighted(&UsageFormat::Anthropic, false, none, PRICES), Some(0));
        // Only a total: charged at the highest weight (4); no usage at all stays no cost.
        let total_only = r#"{"usage":{"total_tokens":10}}"#;
        assert_eq!(read_weighted(&UsageFormat::OpenAi, false, total_only, PRICES), Some(40));
        assert_eq!(read_weighted(&UsageFormat::OpenAi, false, r#"{"usage":null}"#, PRICES), None);
        // Huge counts saturate instead of wrapping.
        let huge = format!(r#"{{"usage":{{"input_tokens":{},"output_tokens":{}}}}}"#, u64::MAX, u64::MAX);
        assert_eq!(read_weighted(&UsageFormat::Anthropic, false, &huge, PRICES), Some(u64::MAX.div_ceil(1000)));
    }

    #[test]
    fn without_weights_a_cached_part_of_the_prompt_is_not_counted_twice() {
        let cached =
            r#"{"usage":{"prompt_tokens":100,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":80}}}"#;
        assert_eq!(read(&UsageFormat::OpenAi, false, &[cached.as_bytes()]), Some(103));
        let gemini =
            r#"{"usageMetadata":{"promptTokenCount":50,"cachedContentTokenCount":40,"candidatesTokenCount":1}}"#;
        assert_eq!(read(&UsageFormat::Gemini, false, &[gemini.as_bytes()]), Some(51));
    }

    #[test]
    fn the_totals_fall_back_to_their_parts() {
        let chat = r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}"#;
        assert_eq!(read(&UsageFormat::OpenAi, false, &[chat.as_bytes()]), Some(12));
        let response = r#"{"output":[],"usage":{"input_tokens":7,"output_tokens":6},"metadata":{}}"#;
        assert_eq!(read(&UsageFormat::OpenAi, false, &[response.as_bytes()]), Some(13));
        let gemini = r#"{"usageMetadata":{"promptTokenCount":3,"candidatesTokenCount":4,"thoughtsTokenCount":5,
            "toolUsePromptTokenCount":6}}"#;
        assert_eq!(read(&UsageFormat::Gemini, false, &[gemini.as_bytes()]), Some(18));
        let anthropic = r#"{"usage":{"input_tokens":3,"output_tokens":4}}"#;
        assert_eq!(read(&UsageFormat::Anthropic, false, &[anthropic.as_bytes()]), Some(7));
    }

    #[test]
    fn no_usage_null_usage_or_malformed_json_is_no_cost() {
        let cases: &[(&UsageFormat, bool, &str)] = &[
            (&UsageFormat::OpenAi, false, r#"{"choices":[{"message":{"content":"hi"}}]}"#),
            (&UsageFormat::OpenAi, false, r#"{"choices":[],"usage":null}"#),
            (&UsageFormat::OpenAi, false, r#"{"choices":[],"usage":{"prompt_tokens":"7"}}"#),
            (&UsageFormat::OpenAi, false, r#"{"choices":[],"usage":{"total_tokens":-3}}"#),
            (&UsageFormat::OpenAi, false, r#"{"choices":[],"usage":{"total_tokens":1"#),
            (&UsageFormat::OpenAi, false, r#"{"choices":[],"usage":{"total_tokens":}"#),
            (&UsageFormat::OpenAi, false, ""),
            (
                &UsageFormat::OpenAi,
                false,
                r#"{"choices":[{"message":{"content":"{\"usage\": {\"total_tokens\": 5}}"}}]}"#,
            ),
            (&UsageFormat::Gemini, false, "<html>502 Bad Gateway</html>"),
            (
                &UsageFormat::Anthropic,
                false,
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            ),
            (
                &UsageFormat::Anthropic,
                true,
                "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\"}}\n\n",
            ),
            (&UsageFormat::Anthropic, true, "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":\n\n"),
            (&UsageFormat::Gemini, true, ": comment\nevent: usageMetadata\nid: 1\nretry: 10\n\n"),
        ];
        for (format, event_stream, body) in cases {
            assert_eq!(read(format, *event_stream, &[body.as_bytes()]), None, "{body}");
        }
        // A stream without `stream_options.include_usage`: every chunk's usage is null.
        let without: String =
            OPENAI_CHAT_STREAM.lines().filter(|line| !line.contains("\"choices\":[]")).collect::<Vec<_>>().join("\n");
        assert_eq!(read(&UsageFormat::OpenAi, true, &[without.as_bytes()]), None);
        // A JSON body read as an event stream has no `data:` line.
        assert_eq!(read(&UsageFormat::OpenAi, true, &[OPENAI_CHAT.as_bytes()]), None);
    }

    #[test]
    fn huge_counts_saturate_and_out_of_range_ones_are_none() {
        let big = r#"{"usage":{"input_tokens":18446744073709551615,"output_tokens":5}}"#;
        assert_eq!(read(&UsageFormat::Anthropic, false, &[big.as_bytes()]), Some(u64::MAX));
        let beyond = r#"{"usage":{"input_tokens":18446744073709551616,"output_tokens":5}}"#;
        assert_eq!(read(&UsageFormat::Anthropic, false, &[beyond.as_bytes()]), Some(5));
    }

    #[test]
    fn a_stream_cut_short_reports_what_it_had_sent() {
        let format = UsageFormat::Anthropic;
        let body = ANTHROPIC_STREAM.as_bytes();
        let start_ends = ANTHROPIC_STREAM.find("\n\nevent: content_block_start").unwrap() + 1;
        let mid = ANTHROPIC_STREAM.find("Hello").unwrap();
        let delta_ends = ANTHROPIC_STREAM.find("\n\nevent: message_stop").unwrap() + 1;
        for (cut, so_far) in
            [(0, None), (start_ends - 1, None), (start_ends, Some(126)), (mid, Some(126)), (delta_ends, Some(140))]
        {
            let mut meter = UsageMeter::new(&format, true);
            meter.feed(&body[..cut]);
            assert_eq!(meter.so_far(), so_far, "cut at {cut}");
        }
        // Gemini: the latest count (the prompt, before the last event).
        let mut meter = UsageMeter::new(&UsageFormat::Gemini, true);
        meter.feed(&GEMINI_STREAM.as_bytes()[..GEMINI_STREAM.find(" is Paris").unwrap()]);
        assert_eq!(meter.so_far(), Some(11));
        // A JSON body reports nothing before its end.
        let mut meter = UsageMeter::new(&UsageFormat::OpenAi, false);
        meter.feed(OPENAI_CHAT.as_bytes());
        assert_eq!(meter.so_far(), None);
        assert_eq!(meter.finish(), Some(29));
        assert_eq!(meter.finish(), Some(29), "finish again");
    }

    #[test]
    fn line_ends_may_be_lf_crlf_or_cr_and_the_last_line_may_lack_one() {
        for end in ["\n", "\r\n", "\r"] {
            let body = ANTHROPIC_STREAM.replace('\n', end);
            assert_eq!(read(&UsageFormat::Anthropic, true, &[body.as_bytes()]), Some(140), "{end:?}");
        }
        let last = "data: {\"choices\":[],\"usage\":{\"total_tokens\":8}}";
        assert_eq!(read(&UsageFormat::OpenAi, true, &[last.as_bytes()]), Some(8));
        let no_space = "data:{\"choices\":[],\"usage\":{\"total_tokens\":8}}\n";
        assert_eq!(read(&UsageFormat::OpenAi, true, &[no_space.as_bytes()]), Some(8));
    }

    /// A body of `size` bytes: a chat completion whose content is `size` bytes of text (a decoy usage
    /// object in the middle), its usage at the end.
    fn large_chat(size: usize) -> Vec<u8> {
        let filler = "Lorem ipsum dolor sit amet, “usage” é ";
        let mut text = filler.repeat(size / filler.len() / 2);
        text.push_str(r#"\"usage\": {\"total_tokens\": 1}"#);
        text.push_str(&filler.repeat(size / filler.len() / 2));
        let usage = r#""usage":{"prompt_tokens":4000,"completion_tokens":90000,"total_tokens":94000}"#;
        format!(r#"{{"choices":[{{"message":{{"content":"{text}"}}}}],{usage},"system_fingerprint":null}}"#)
            .into_bytes()
    }

    /// Chunk sizes from 1 to `max` bytes, a fixed pseudo-random sequence.
    fn chunk_sizes(max: usize) -> impl Iterator<Item = usize> {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        core::iter::from_fn(move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            Some(1 + (state % max as u64) as usize)
        })
    }

    fn feed_bounded(meter: &mut UsageMeter, body: &[u8], max_chunk: usize) {
        let mut rest = body;
        for size in chunk_sizes(max_chunk) {
            if rest.is_empty() {
                break;
            }
            let (chunk, tail) = rest.split_at(size.min(rest.len()));
            meter.feed(chunk);
            rest = tail;
            assert!(meter.tail.bytes.len() <= TAIL_BYTES, "{} bytes kept", meter.tail.bytes.len());
            assert!(meter.tail.bytes.capacity() <= TAIL_BYTES, "{} bytes allocated", meter.tail.bytes.capacity());
        }
    }

    /// A body far larger than [`TAIL_BYTES`]: 5 MB natively; 1 MB on wasm32, where Node 20 (the WASI runner
    /// of `make test-wasm`) crashed with SIGSEGV when it exited after the 5 MB tests had run, every test passed.
    const LARGE: usize = if cfg!(target_arch = "wasm32") { 1 << 20 } else { 5 << 20 };

    #[test]
    fn a_large_json_body_keeps_its_tail_only_and_finds_the_usage_at_its_end() {
        let body = large_chat(LARGE);
        assert!(body.len() > LARGE);
        for max_chunk in [100, 16 * 1024, 1 << 20] {
            let mut meter = UsageMeter::new(&UsageFormat::OpenAi, false);
            feed_bounded(&mut meter, &body, max_chunk);
            assert_eq!(meter.finish(), Some(94000), "chunks up to {max_chunk}");
            let mut meter = UsageMeter::new(&paths(&["usage.prompt_tokens", "usage.completion_tokens"]), false);
            feed_bounded(&mut meter, &body, max_chunk);
            assert_eq!(meter.finish(), Some(94000), "paths, chunks up to {max_chunk}");
        }
        // The usage's start beyond the tail: not seen.
        let far = format!(r#"{{"usage":{{"total_tokens":5}},"metadata":{{"note":"{}"}}}}"#, "x".repeat(TAIL_BYTES));
        assert_eq!(read(&UsageFormat::OpenAi, false, &[far.as_bytes()]), None);
    }

    #[test]
    fn a_long_event_line_keeps_its_end_and_a_long_other_line_is_dropped() {
        // A Gemini event carrying a 5 MB image (1 MB on wasm32), its usage at the end of the line.
        let image = "iVBORw0KGgo".repeat(LARGE / 11);
        let part = format!(r#"{{"inlineData": {{"mimeType": "image/png", "data": "{image}"}}}}"#);
        let usage = r#""usageMetadata": {"promptTokenCount": 7,"candidatesTokenCount": 1290,"totalTokenCount": 1297}"#;
        let event = format!("data: {{\"candidates\": [{{\"content\": {{\"parts\": [{part}]}}}}],{usage}}}\r\n\r\n");
        let comment = format!(": {}\n", "k".repeat(100_000));
        let first_events = &GEMINI_STREAM[..GEMINI_STREAM.rfind("data:").unwrap()];
        let stream = format!("{first_events}{comment}{event}{comment}");
        for max_chunk in [1000, 64 * 1024, 8 << 20] {
            let mut meter = UsageMeter::new(&UsageFormat::Gemini, true);
            feed_bounded(&mut meter, stream.as_bytes(), max_chunk);
            assert_eq!(meter.finish(), Some(1297), "chunks up to {max_chunk}");
            let mut meter = UsageMeter::new(&paths(&["usageMetadata.totalTokenCount"]), true);
            feed_bounded(&mut meter, stream.as_bytes(), max_chunk);
            assert_eq!(meter.finish(), Some(1297), "paths, chunks up to {max_chunk}");
        }
    }

    #[test]
    fn paths_follow_the_root_in_a_whole_body() {
        let body = r#"{"result":{"text":"ok"},"meta":{"billing":{"input":3,"output":4}},"billing":{"input":100}}"#;
        let format = paths(&["meta.billing.input", "meta.billing.output"]);
        assert_eq!(read(&format, false, &[body.as_bytes()]), Some(7));
        assert_eq!(read(&paths(&["billing.input"]), false, &[body.as_bytes()]), Some(100));
        assert_eq!(read(&paths(&["result.text"]), false, &[body.as_bytes()]), None);
        assert_eq!(read(&paths(&["missing"]), false, &[body.as_bytes()]), None);
        assert_eq!(read(&UsageFormat::Paths(vec![vec![]]), false, &[body.as_bytes()]), None);
        let events = "data: {\"units\":2}\n\ndata: {\"other\":1}\n\ndata: {\"units\":5}\n\n";
        assert_eq!(read(&paths(&["units"]), true, &[events.as_bytes()]), Some(5));
    }

    #[test]
    fn a_usage_key_in_a_string_or_a_schema_is_not_the_usage() {
        // The reply's text quotes a usage object, and the last key named usage is a tool's schema property.
        let body = concat!(
            r#"{"choices":[{"message":{"content":"see \"usage\": {\"total_tokens\": 999}"}}],"#,
            r#""usage":{"total_tokens":42},"tools":[{"parameters":{"properties":{"usage":{"type":"string"}}}}]}"#
        );
        assert_eq!(read(&UsageFormat::OpenAi, false, &[body.as_bytes()]), Some(42));
        // A body whose tail begins inside a string that holds an unescaped-looking key.
        let mut meter = UsageMeter::new(&UsageFormat::OpenAi, false);
        meter.feed(r#"{"choices":[{"message":{"content":""#.as_bytes());
        meter.feed(&[b'x'; 2 * TAIL_BYTES]);
        meter.feed(br#"\"usage\":{\"total_tokens\":7}"}}],"usage":{"total_tokens":8}}"#);
        assert_eq!(meter.finish(), Some(8));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn chunks<'b>(body: &'b [u8], cuts: &[prop::sample::Index]) -> Vec<&'b [u8]> {
            let mut points: Vec<usize> = cuts.iter().map(|cut| cut.index(body.len() + 1)).collect();
            points.sort_unstable();
            let mut start = 0;
            let mut pieces = Vec::new();
            for point in points.into_iter().chain([body.len()]) {
                pieces.push(&body[start..point]);
                start = point;
            }
            pieces
        }

        proptest! {
            #[test]
            fn any_chunking_of_a_sample_gives_its_cost(sample in any::<prop::sample::Index>(),
                                                       cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..24)) {
                let samples = samples();
                let (format, event_stream, body, cost) = &samples[sample.index(samples.len())];
                prop_assert_eq!(read(format, *event_stream, &chunks(body.as_bytes(), &cuts)), *cost);
            }
        }

        /// Bytes close to the samples' (keys, numbers, punctuation, line ends), where parsing goes wrong if it can.
        const JSONISH: &str = concat!(
            "(data: |event: |\\{|\\}|\\[|\\]|\"usage\"|\"usageMetadata\"|\"total_tokens\"|\"totalTokenCount\"|",
            "\"input_tokens\"|:|,|null|[0-9]{1,21}|-1|\r|\n| |é|\\\\\"|x){0,200}"
        );

        fn formats() -> [UsageFormat; 4] {
            [
                UsageFormat::OpenAi,
                UsageFormat::Anthropic,
                UsageFormat::Gemini,
                paths(&["usage.total_tokens", "total_tokens"]),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]

            #[test]
            fn any_bytes_read_alike_in_any_chunks(body in JSONISH, noise in prop::collection::vec(any::<u8>(), 0..64),
                                                  cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8)) {
                let mut body = body.into_bytes();
                body.extend(noise);
                for format in &formats() {
                    for event_stream in [false, true] {
                        let whole = read(format, event_stream, &[&body]);
                        prop_assert_eq!(read(format, event_stream, &chunks(&body, &cuts)), whole);
                    }
                }
            }
        }
    }
}
