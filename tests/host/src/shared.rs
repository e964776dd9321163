//! What all VMs of a host share, as in Envoy: shared data with CAS, shared queues, metrics (Envoy stats)
//! and the log.
//!
//! Sources: proxy-wasm-cpp-host `src/shared_data.cc` (CAS semantics), `src/shared_queue.cc`, Envoy
//! `source/extensions/common/wasm/context.cc` (`defineMetric`, `incrementMetric`, `recordMetric`,
//! `getMetric`), all checked with `probe/` in Envoy 1.40 (`probe/envoy-1.40-observed.txt`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::abi::{LogLevel, Status};
use crate::faults::Faults;

/// Locks a mutex, ignoring poisoning (a panic elsewhere must not hide the state from the report).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What shared data entries hold ([`SharedData::usage`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SharedDataUsage {
    /// Entries.
    pub keys: usize,
    /// Their keys' and values' total size, bytes.
    pub bytes: usize,
}

/// Key-value data shared by every VM of the host (Envoy: by every VM with the same `vm_id`).
#[derive(Debug)]
pub struct SharedData {
    entries: HashMap<Vec<u8>, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl Default for SharedData {
    fn default() -> Self {
        SharedData { entries: HashMap::new(), next_cas: 1 }
    }
}

impl SharedData {
    /// The value and its CAS; `NotFound` for a missing key.
    pub fn get(&self, key: &[u8]) -> Result<(Vec<u8>, u32), Status> {
        self.entries.get(key).cloned().ok_or(Status::NotFound)
    }

    /// Sets a value. `cas` 0 means "no check"; otherwise an existing key whose CAS differs answers
    /// `CasMismatch`. A missing key is created whatever `cas` says (cpp-host `SharedData::set`; observed:
    /// `set_new_with_cas_7 status=0`). Every write gets a new CAS, never 0.
    pub fn set(&mut self, key: &[u8], value: &[u8], cas: u32) -> Result<(), Status> {
        let next = self.bump();
        match self.entries.get_mut(key) {
            Some(entry) => {
                if cas != 0 && cas != entry.1 {
                    return Err(Status::CasMismatch);
                }
                *entry = (value.to_vec(), next);
            }
            None => {
                self.entries.insert(key.to_vec(), (value.to_vec(), next));
            }
        }
        Ok(())
    }

    /// How many entries have a key starting with `prefix`, and their keys' and values' total size (bytes).
    pub fn usage(&self, prefix: &[u8]) -> SharedDataUsage {
        let mut usage = SharedDataUsage::default();
        for (key, (value, _)) in self.entries.iter().filter(|(key, _)| key.starts_with(prefix)) {
            usage.keys += 1;
            usage.bytes += key.len() + value.len();
        }
        usage
    }

    fn bump(&mut self) -> u32 {
        let cas = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1);
        if self.next_cas == 0 {
            self.next_cas = 1;
        }
        cas
    }
}

/// A shared queue: registered by one VM's root context, filled by any VM.
#[derive(Debug)]
struct Queue {
    name: Vec<u8>,
    owner_vm: usize,
    owner_context: u32,
    items: VecDeque<Vec<u8>>,
}

/// Shared queues by token (tokens start at 1; 0 means "none").
#[derive(Debug, Default)]
pub struct SharedQueues {
    queues: Vec<Queue>,
}

impl SharedQueues {
    /// Registers (or re-registers) a queue; returns its token.
    pub fn register(&mut self, name: &[u8], vm: usize, root_context: u32) -> u32 {
        if let Some(at) = self.queues.iter().position(|q| q.name == name) {
            if let Some(q) = self.queues.get_mut(at) {
                q.owner_vm = vm;
                q.owner_context = root_context;
            }
            return token_of(at);
        }
        self.queues.push(Queue {
            name: name.to_vec(),
            owner_vm: vm,
            owner_context: root_context,
            items: VecDeque::new(),
        });
        token_of(self.queues.len() - 1)
    }

    /// The token of a registered queue.
    pub fn resolve(&self, name: &[u8]) -> Option<u32> {
        self.queues.iter().position(|q| q.name == name).map(token_of)
    }

    /// Appends an item; returns the (VM, root context) to notify with `proxy_on_queue_ready`.
    pub fn enqueue(&mut self, token: u32, item: &[u8]) -> Result<(usize, u32), Status> {
        let queue = self.get_mut(token)?;
        queue.items.push_back(item.to_vec());
        Ok((queue.owner_vm, queue.owner_context))
    }

    /// Takes the oldest item: `Empty` if none, `NotFound` for an unknown token.
    pub fn dequeue(&mut self, token: u32) -> Result<Vec<u8>, Status> {
        self.get_mut(token)?.items.pop_front().ok_or(Status::Empty)
    }

    fn get_mut(&mut self, token: u32) -> Result<&mut Queue, Status> {
        let index = usize::try_from(token).ok().and_then(|t| t.checked_sub(1)).ok_or(Status::NotFound)?;
        self.queues.get_mut(index).ok_or(Status::NotFound)
    }
}

fn token_of(index: usize) -> u32 {
    u32::try_from(index + 1).unwrap_or(u32::MAX)
}

/// The kind of a metric (`proxy_define_metric`'s type argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricKind {
    /// 0: only grows.
    Counter,
    /// 1: set, increased, decreased.
    Gauge,
    /// 2: recorded values; cannot be read back by the guest.
    Histogram,
}

impl MetricKind {
    /// The kind for a number (`BadArgument` above 2).
    pub fn from_u32(value: u32) -> Option<Self> {
        Some(match value {
            0 => Self::Counter,
            1 => Self::Gauge,
            2 => Self::Histogram,
            _ => return None,
        })
    }

    /// Envoy keeps the type in the low two bits of a metric id (`Wasm::kMetricTypeMask`).
    pub fn of_id(id: u32) -> Option<Self> {
        Self::from_u32(id & 3)
    }
}

/// A metric's value as the host reports it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MetricValue {
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// Counter or gauge value; for a histogram, the number of recorded values.
    pub value: u64,
    /// Histogram only: the recorded values.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub recorded: Vec<u64>,
}

/// Metrics by name, shared by every VM (Envoy: stats named `wasmcustom.<name>`; the same name defined by
/// several VMs is the same stat).
#[derive(Debug, Default)]
pub struct Metrics {
    by_name: BTreeMap<String, MetricValue>,
}

impl Metrics {
    /// Defines a metric (idempotent: an existing one is kept).
    pub fn define(&mut self, name: &str, kind: MetricKind) {
        self.by_name.entry(name.to_string()).or_insert(MetricValue { kind, value: 0, recorded: Vec::new() });
    }

    /// `proxy_increment_metric`: counters accept only positive offsets (else `BadArgument`); gauges add
    /// or subtract; histograms answer `BadArgument`.
    pub fn increment(&mut self, name: &str, offset: i64) -> Result<(), Status> {
        let metric = self.by_name.get_mut(name).ok_or(Status::NotFound)?;
        match metric.kind {
            MetricKind::Counter if offset > 0 => {
                metric.value = metric.value.saturating_add(offset.unsigned_abs());
                Ok(())
            }
            MetricKind::Counter | MetricKind::Histogram => Err(Status::BadArgument),
            MetricKind::Gauge => {
                metric.value = if offset >= 0 {
                    metric.value.saturating_add(offset.unsigned_abs())
                } else {
                    metric.value.saturating_sub(offset.unsigned_abs())
                };
                Ok(())
            }
        }
    }

    /// `proxy_record_metric`: a counter adds the value, a gauge is set to it, a histogram records it.
    pub fn record(&mut self, name: &str, value: u64) -> Result<(), Status> {
        let metric = self.by_name.get_mut(name).ok_or(Status::NotFound)?;
        match metric.kind {
            MetricKind::Counter => metric.value = metric.value.saturating_add(value),
            MetricKind::Gauge => metric.value = value,
            MetricKind::Histogram => {
                metric.value = metric.value.saturating_add(1);
                metric.recorded.push(value);
            }
        }
        Ok(())
    }

    /// `proxy_get_metric`: counters and gauges; histograms answer `BadArgument`.
    pub fn get(&self, name: &str) -> Result<u64, Status> {
        let metric = self.by_name.get(name).ok_or(Status::NotFound)?;
        match metric.kind {
            MetricKind::Histogram => Err(Status::BadArgument),
            _ => Ok(metric.value),
        }
    }

    /// Every metric by name (the guest's name, without Envoy's `wasmcustom.` prefix).
    pub fn snapshot(&self) -> BTreeMap<String, MetricValue> {
        self.by_name.clone()
    }
}

/// A duration in whole nanoseconds, `u64::MAX` if it does not fit (after the year 2554).
pub fn saturating_ns(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// Who wrote a log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LogSource {
    /// `proxy_log`.
    ProxyLog,
    /// WASI `fd_write` to stdout (info) or stderr (error), trailing newline removed, as Envoy does.
    Stdio,
    /// The emulator itself (VM failures, dropped callbacks, refused configuration...).
    Host,
}

/// One log line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LogLine {
    /// The VM (`None` for host-wide lines).
    pub vm: Option<usize>,
    /// The level.
    pub level: LogLevel,
    /// The context the guest was running for (0 = none / VM start).
    pub context_id: u32,
    /// Who wrote it.
    pub source: LogSource,
    /// The text.
    pub message: String,
    /// Milliseconds since the host was built.
    pub at_ms: u64,
}

/// Everything shared by the VMs of a host.
#[derive(Debug)]
pub struct Shared {
    /// Shared data (`proxy_get_shared_data` / `proxy_set_shared_data`).
    pub data: Mutex<SharedData>,
    /// Shared queues.
    pub queues: Mutex<SharedQueues>,
    /// Metrics.
    pub metrics: Mutex<Metrics>,
    /// The log.
    pub logs: Mutex<Vec<LogLine>>,
    /// Lines below this level are dropped, as Envoy drops them (its default: info).
    pub log_level: LogLevel,
    /// Also print each line on stderr as it is written.
    pub echo_logs: bool,
    /// When the host was built.
    pub started: Instant,
    /// The faults in force ([`crate::faults`]).
    pub faults: Mutex<Faults>,
    /// How far the guest's wall clock is ahead of real time, in nanoseconds ([`Shared::guest_time_ns`]).
    pub clock_offset_ns: AtomicU64,
    /// The fuel profile, when enabled ([`FuelProfile`]).
    pub fuel_profile: Option<Mutex<FuelProfile>>,
}

/// Where a guest spends its fuel, by segment: the guest code run between two hostcalls (`a -> b`: after
/// hostcall or export `a` returned or started, until hostcall `b` was called; `b` = `return` at the end of
/// the export), and `(in b)`: guest code the host ran during hostcall `b` (`proxy_on_memory_allocate` for
/// the bytes it hands over). A coarse profile without a profiler: fuel is about one per wasm instruction.
#[derive(Debug, Default, Clone)]
pub struct FuelProfile {
    /// Segment -> (times, fuel).
    pub segments: BTreeMap<String, (u64, u64)>,
}

impl FuelProfile {
    /// Adds `fuel` spent in `segment`.
    pub fn add(&mut self, segment: String, fuel: u64) {
        let entry = self.segments.entry(segment).or_default();
        entry.0 += 1;
        entry.1 += fuel;
    }

    /// The segments, most fuel first: (segment, times, total fuel).
    pub fn ranked(&self) -> Vec<(String, u64, u64)> {
        let mut rows: Vec<_> = self.segments.iter().map(|(k, (n, f))| (k.clone(), *n, *f)).collect();
        rows.sort_by_key(|row| core::cmp::Reverse(row.2));
        rows
    }
}

impl Shared {
    /// Empty shared state.
    pub fn new(log_level: LogLevel, echo_logs: bool) -> Arc<Self> {
        Self::with_profile(log_level, echo_logs, false)
    }

    /// Empty shared state, with a [`FuelProfile`] if `profile`.
    pub fn with_profile(log_level: LogLevel, echo_logs: bool, profile: bool) -> Arc<Self> {
        Arc::new(Shared {
            data: Mutex::new(SharedData::default()),
            queues: Mutex::new(SharedQueues::default()),
            metrics: Mutex::new(Metrics::default()),
            logs: Mutex::new(Vec::new()),
            log_level,
            echo_logs,
            started: Instant::now(),
            faults: Mutex::new(Faults::NONE),
            clock_offset_ns: AtomicU64::new(0),
            fuel_profile: profile.then(|| Mutex::new(FuelProfile::default())),
        })
    }

    /// The guest's wall clock: real time (`SystemTime`) plus the clock offset, in nanoseconds since the
    /// Unix epoch (what `proxy_get_current_time_nanoseconds` and WASI's realtime clock answer).
    pub fn guest_time_ns(&self) -> u64 {
        let real = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, saturating_ns);
        real.saturating_add(self.clock_offset_ns.load(Ordering::SeqCst))
    }

    /// The clock offset.
    pub fn clock_offset(&self) -> Duration {
        Duration::from_nanos(self.clock_offset_ns.load(Ordering::SeqCst))
    }

    /// Moves the guest's wall clock ahead by `by` (saturating); the new total offset.
    pub fn advance_clock(&self, by: Duration) -> Duration {
        let by = saturating_ns(by);
        let previous = self
            .clock_offset_ns
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |offset| Some(offset.saturating_add(by)))
            .unwrap_or_else(|offset| offset);
        Duration::from_nanos(previous.saturating_add(by))
    }

    /// Appends a log line (dropped below the log level, except the host's own lines).
    pub fn log(&self, vm: Option<usize>, level: LogLevel, context_id: u32, source: LogSource, message: String) {
        if level < self.log_level && source != LogSource::Host {
            return;
        }
        let at_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        if self.echo_logs {
            let who = vm.map_or_else(|| "host".to_string(), |v| format!("vm{v}"));
            eprintln!("[{at_ms:>7} ms][{level}][{who} ctx {context_id}] {message}");
        }
        lock(&self.logs).push(LogLine { vm, level, context_id, source, message, at_ms });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_semantics_follow_envoy() {
        let mut data = SharedData::default();
        assert_eq!(data.get(b"k"), Err(Status::NotFound));
        assert_eq!(data.set(b"k", b"a", 7), Ok(()), "a missing key ignores cas");
        let (_, cas1) = data.get(b"k").unwrap();
        assert_ne!(cas1, 0);
        assert_eq!(data.set(b"k", b"b", 0), Ok(()));
        let (_, cas2) = data.get(b"k").unwrap();
        assert_ne!(cas2, cas1);
        assert_eq!(data.set(b"k", b"c", cas1), Err(Status::CasMismatch));
        assert_eq!(data.set(b"k", b"d", cas2), Ok(()));
        assert_eq!(data.get(b"k").unwrap().0, b"d");
    }

    #[test]
    fn metric_semantics_follow_envoy() {
        let mut m = Metrics::default();
        m.define("c", MetricKind::Counter);
        m.define("g", MetricKind::Gauge);
        m.define("h", MetricKind::Histogram);
        assert_eq!(m.increment("c", 0), Err(Status::BadArgument));
        assert_eq!(m.increment("c", -1), Err(Status::BadArgument));
        assert_eq!(m.increment("c", 2), Ok(()));
        assert_eq!(m.record("c", 5), Ok(()));
        assert_eq!(m.get("c"), Ok(7));
        assert_eq!(m.record("g", 10), Ok(()));
        assert_eq!(m.increment("g", -3), Ok(()));
        assert_eq!(m.get("g"), Ok(7));
        assert_eq!(m.record("h", 7), Ok(()));
        assert_eq!(m.increment("h", 1), Err(Status::BadArgument));
        assert_eq!(m.get("h"), Err(Status::BadArgument));
        assert_eq!(m.get("nope"), Err(Status::NotFound));
    }

    #[test]
    fn queues_hand_items_over_in_order() {
        let mut q = SharedQueues::default();
        let token = q.register(b"q", 1, 1);
        assert_eq!(q.resolve(b"q"), Some(token));
        assert_eq!(q.dequeue(token), Err(Status::Empty));
        assert_eq!(q.enqueue(token, b"a"), Ok((1, 1)));
        assert_eq!(q.dequeue(token), Ok(b"a".to_vec()));
        assert_eq!(q.dequeue(99), Err(Status::NotFound));
    }
}
