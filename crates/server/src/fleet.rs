//! The models one server serves: their aliases, which are loaded, and the memory they hold.
//!
//! Each loaded model runs on its own engine thread ([`crate::engine_thread`]): its model, KV
//! cache and engine live there, so two models answer at once. A request names a model
//! (`model`), and its handler takes a [`Lease`] on it ([`Fleet::acquire`]) for as long as the
//! request runs. A model not loaded yet is loaded on first use, the request waiting meanwhile
//! (Ollama's and llama-server's router mode's behaviour); when loading it would exceed the
//! memory budget (`--models-memory-mb`) or the count (`--models-max`), the least recently used
//! models that no request holds are unloaded first. A model some request holds is never
//! unloaded: the load waits until enough leases end, so no request is lost to an unload.
//!
//! A server of one model answers to any `model` name (as it always has); with several, a
//! missing `model` means the first, and an unknown one is 404 `model_not_found`.
//!
//! What a model holds is counted as its weights as held plus its KV cache pool, measured when it
//! has loaded; before its first load, the size of its files stands in.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::ApiError;
use crate::routes::Ready;
use crate::worker::Command;

/// A model the server may serve.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    /// The name requests use (`model`) and `/v1/models` lists: letters, digits and `._:-`.
    pub alias: String,
    /// Where it comes from (a path), for the log.
    pub source: String,
    /// Bytes it is expected to hold before it has loaded once (its files' size).
    pub estimated_bytes: u64,
}

/// How much the loaded models may hold together, and how long a load waits for room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FleetLimits {
    /// Most bytes of weights and KV caches loaded at once (`None`: no limit).
    pub memory_bytes: Option<u64>,
    /// Most models loaded at once (`None`: no limit).
    pub max_loaded: Option<usize>,
    /// How long a request waits for room to load its model (for the models that would have to
    /// unload to become idle) before it gets 503 `model_busy`.
    pub room_wait: Duration,
}

impl Default for FleetLimits {
    /// No limits; a wait of five minutes (Ollama's default load timeout).
    fn default() -> Self {
        Self {
            memory_bytes: None,
            max_loaded: None,
            room_wait: Duration::from_secs(300),
        }
    }
}

/// What a model's entry is doing.
enum State {
    Unloaded,
    /// Its engine thread is loading it.
    Loading,
    Loaded(Arc<Ready>),
    /// Its engine thread was told to stop and has not finished freeing it.
    Unloading,
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Unloaded => "unloaded",
            State::Loading => "loading",
            State::Loaded(_) => "loaded",
            State::Unloading => "unloading",
        }
    }

    /// Whether it holds (or is about to hold) memory.
    fn holds_memory(&self) -> bool {
        !matches!(self, State::Unloaded)
    }
}

struct Slot {
    entry: ModelEntry,
    state: State,
    /// Requests holding it.
    leases: usize,
    last_used: Instant,
    /// Bytes it holds when loaded: measured at its last load, else the estimate.
    bytes: u64,
    /// Load attempts so far; a request waiting on attempt `n` learns of its failure here.
    attempt: u64,
    failure: Option<(u64, String)>,
    loads: u64,
    unloads: u64,
    /// How long its last load took.
    load_time: Duration,
    /// When it last finished loading (Unix seconds), for `/v1/models`.
    created: u64,
    /// When it unloads once no request holds it (a request's `keep_alive`, Ollama's field);
    /// `None`: it stays until room is needed.
    expires: Option<Instant>,
    /// When the pending keep-alive timer wakes, if one is pending.
    timer: Option<Instant>,
}

struct Inner {
    slots: Vec<Slot>,
    shutting_down: bool,
}

impl Inner {
    /// The loaded models no request holds (but `except`), least recently used first.
    fn idle(&self, except: Option<usize>) -> Vec<usize> {
        let mut idle: Vec<usize> = (0..self.slots.len())
            .filter(|&i| {
                Some(i) != except
                    && self.slots[i].leases == 0
                    && matches!(self.slots[i].state, State::Loaded(_))
            })
            .collect();
        idle.sort_by_key(|&i| self.slots[i].last_used);
        idle
    }

    /// Bytes the models that are loaded, loading or unloading hold, and how many they are.
    fn held(&self) -> (u64, usize) {
        self.slots
            .iter()
            .filter(|s| s.state.holds_memory())
            .fold((0u64, 0), |(bytes, count), s| {
                (bytes.saturating_add(s.bytes), count + 1)
            })
    }
}

/// Starts the engine thread of the model at an index.
pub(crate) type Spawner = Box<dyn Fn(usize) -> std::io::Result<()> + Send + Sync>;

/// The models, their state and their leases.
pub(crate) struct Fleet {
    inner: Mutex<Inner>,
    /// Wakes requests waiting for a model to load or for room to load it.
    changed: tokio::sync::Notify,
    /// Wakes [`Fleet::wait_stopped`] when an engine thread ends.
    stopped: Condvar,
    limits: FleetLimits,
    spawn: OnceLock<Spawner>,
    /// The first model has loaded once: the server is up (`/health` says 200 from then on).
    started: AtomicBool,
}

/// A model as `/v1/models` lists it.
pub(crate) struct Listed {
    pub alias: String,
    pub state: &'static str,
    pub created: u64,
    /// Its context, once it has loaded.
    pub max_model_len: Option<usize>,
}

/// A request's hold on a loaded model: it is not unloaded while this lives.
pub(crate) struct Lease {
    fleet: Arc<Fleet>,
    index: usize,
    ready: Arc<Ready>,
}

impl Lease {
    /// The model, as the handlers need it.
    pub fn ready(&self) -> &Arc<Ready> {
        &self.ready
    }

    /// Keeps the model loaded for `keep` after the last request holding it ends, then unloads
    /// it (`Some(ZERO)`: as soon as it is idle); `None`: until room is needed. The last request
    /// to say decides, as in Ollama.
    pub fn keep_alive(&self, keep: Option<Duration>) {
        self.fleet.set_keep_alive(self.index, keep);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.fleet.release(self.index);
    }
}

impl Fleet {
    /// A fleet of `entries`, none loaded.
    ///
    /// # Errors
    /// No entry, an alias that is not a valid name ([`valid_alias`]), or one given twice.
    pub fn new(entries: Vec<ModelEntry>, limits: FleetLimits) -> Result<Self, String> {
        if entries.is_empty() {
            return Err("no model to serve".into());
        }
        for (i, entry) in entries.iter().enumerate() {
            if !valid_alias(&entry.alias) {
                return Err(format!(
                    "{:?} cannot name a model: use 1 to 64 letters, digits and ._:-",
                    entry.alias
                ));
            }
            if entries[..i].iter().any(|e| e.alias == entry.alias) {
                return Err(format!(
                    "two models are named {:?}: give each its own (ALIAS=PATH)",
                    entry.alias
                ));
            }
        }
        let now = Instant::now();
        let slots = entries
            .into_iter()
            .map(|entry| Slot {
                bytes: entry.estimated_bytes,
                entry,
                state: State::Unloaded,
                leases: 0,
                last_used: now,
                attempt: 0,
                failure: None,
                loads: 0,
                unloads: 0,
                load_time: Duration::ZERO,
                created: 0,
                expires: None,
                timer: None,
            })
            .collect();
        Ok(Self {
            inner: Mutex::new(Inner {
                slots,
                shutting_down: false,
            }),
            changed: tokio::sync::Notify::new(),
            stopped: Condvar::new(),
            limits,
            spawn: OnceLock::new(),
            started: AtomicBool::new(false),
        })
    }

    /// How engine threads are started (set once, by [`crate::Server::serve`]).
    pub fn set_spawner(&self, spawn: Spawner) {
        let _ = self.spawn.set(spawn);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind: go on with it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the first model has loaded (the server is up).
    pub fn started(&self) -> bool {
        self.started.load(Ordering::SeqCst)
    }

    /// The alias of the model at `index`.
    pub fn alias(&self, index: usize) -> String {
        self.lock().slots[index].entry.alias.clone()
    }

    /// The slot `name` picks: any name (or none) in a one-model server; none means the first.
    fn find(inner: &Inner, name: Option<&str>) -> Result<usize, ApiError> {
        match name {
            _ if inner.slots.len() == 1 => Ok(0),
            None => Ok(0),
            Some(name) => inner
                .slots
                .iter()
                .position(|s| s.entry.alias == name)
                .ok_or_else(|| {
                    let known: Vec<&str> =
                        inner.slots.iter().map(|s| s.entry.alias.as_str()).collect();
                    ApiError::model_not_found(name, &known)
                }),
        }
    }

    /// A lease on the model `name` picks, loading it first (after unloading idle models to
    /// make room) when it is not loaded; waits while it loads or while every model that would
    /// have to make room is busy.
    ///
    /// # Errors
    /// 404 for an unknown name; 503 before the server is up, while it stops, when loading
    /// the model failed, or when no room was made for it within
    /// [`FleetLimits::room_wait`] (the models that would have to unload stayed busy).
    pub async fn acquire(self: &Arc<Self>, name: Option<&str>) -> Result<Lease, ApiError> {
        if !self.started() {
            return Err(ApiError::loading());
        }
        let mut waiting_on: Option<u64> = None;
        // Waiting for room ends here; waiting for a load in progress does not.
        let room_deadline = tokio::time::Instant::now() + self.limits.room_wait;
        loop {
            let mut waiting_for_room = None;
            let notified = self.changed.notified();
            tokio::pin!(notified);
            {
                let mut inner = self.lock();
                if inner.shutting_down {
                    return Err(ApiError::shutting_down());
                }
                let index = Self::find(&inner, name)?;
                if let State::Loaded(ready) = &inner.slots[index].state {
                    let ready = ready.clone();
                    let slot = &mut inner.slots[index];
                    slot.leases += 1;
                    slot.last_used = Instant::now();
                    return Ok(Lease {
                        fleet: self.clone(),
                        index,
                        ready,
                    });
                }
                if matches!(inner.slots[index].state, State::Unloaded) {
                    if let Some(why) = Self::failed(&inner.slots[index], waiting_on) {
                        return Err(why);
                    }
                    if self.make_room(&mut inner, index) {
                        self.start_loading(&mut inner, index);
                        let slot = &inner.slots[index];
                        if let Some(why) = Self::failed(slot, Some(slot.attempt)) {
                            return Err(why);
                        }
                    }
                }
                match inner.slots[index].state {
                    State::Loading => waiting_on = Some(inner.slots[index].attempt),
                    _ => waiting_for_room = Some(inner.slots[index].entry.alias.clone()),
                }
                // Registered before the lock is let go: a change made after it wakes us.
                notified.as_mut().enable();
            }
            match waiting_for_room {
                Some(alias) => {
                    if tokio::time::timeout_at(room_deadline, notified)
                        .await
                        .is_err()
                    {
                        return Err(ApiError::no_room_for_model(&alias, self.limits.room_wait));
                    }
                }
                None => notified.await,
            }
        }
    }

    /// The 503 for a request that waited on load attempt `waited` of `slot`, if that attempt
    /// failed.
    fn failed(slot: &Slot, waited: Option<u64>) -> Option<ApiError> {
        match (waited, &slot.failure) {
            (Some(waited), Some((attempt, why))) if waited == *attempt => {
                Some(ApiError::model_unavailable(&slot.entry.alias, why))
            }
            _ => None,
        }
    }

    /// Loads the model at `index` and waits until it has loaded; the server is up once it
    /// has. For the first model, at start-up.
    ///
    /// # Errors
    /// Why it could not load.
    pub fn load_blocking(self: &Arc<Self>, index: usize) -> Result<(), String> {
        let mut inner = self.lock();
        self.start_loading(&mut inner, index);
        loop {
            let slot = &inner.slots[index];
            match (&slot.state, &slot.failure) {
                (State::Loaded(_), _) => {
                    self.started.store(true, Ordering::SeqCst);
                    return Ok(());
                }
                (State::Unloaded, Some((_, why))) => return Err(why.clone()),
                (State::Unloading, _) | (State::Unloaded, None) => {
                    return Err("the server stopped while the model loaded".into());
                }
                (State::Loading, _) => {}
            }
            inner = self.stopped.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether `count` models holding `held` bytes are within the limits.
    fn within(&self, held: u64, count: usize) -> bool {
        self.limits.memory_bytes.is_none_or(|b| held <= b)
            && self.limits.max_loaded.is_none_or(|m| count <= m)
    }

    /// Whether the model at `index` may start loading now. When loading it would exceed the
    /// limits, unloads the least recently used idle models that make it fit (none, if even
    /// all of them would not) and says no: the caller waits for them to finish unloading, or
    /// for leases to end.
    fn make_room(&self, inner: &mut Inner, index: usize) -> bool {
        let need = inner.slots[index].bytes;
        let (held, count) = inner.held();
        // Whether `count` models holding `held` bytes leave room for this one.
        let fits = |held: u64, count: usize| self.within(held.saturating_add(need), count + 1);
        if fits(held, count) {
            return true;
        }
        // Alone, it is over the budget (the start-up check judged by an estimate): load it
        // once nothing else holds memory.
        if count == 0 {
            return true;
        }
        let (mut freed, mut victims) = (0u64, Vec::new());
        for i in inner.idle(Some(index)) {
            if fits(held.saturating_sub(freed), count - victims.len()) {
                break;
            }
            freed = freed.saturating_add(inner.slots[i].bytes);
            victims.push(i);
        }
        let alone = count == victims.len();
        if !(fits(held.saturating_sub(freed), count - victims.len()) || alone) {
            return false;
        }
        let wanted = inner.slots[index].entry.alias.clone();
        for i in victims {
            Self::begin_unload(
                &mut inner.slots[i],
                Some(&format!("to make room for {wanted}")),
            );
        }
        false
    }

    /// Tells the engine thread of a loaded model to stop; `why` an idle one is unloaded, for
    /// the log (`None`: the server is stopping).
    fn begin_unload(slot: &mut Slot, why: Option<&str>) {
        if let State::Loaded(ready) = std::mem::replace(&mut slot.state, State::Unloading) {
            if let Some(why) = why {
                tracing::info!(
                    target: "kiln::serve",
                    model = %slot.entry.alias,
                    mib = slot.bytes >> 20,
                    "unloading {} (least recently used, no request running) {why}",
                    slot.entry.alias
                );
            }
            let _ = ready.commands.send(Command::Shutdown);
        }
    }

    fn start_loading(&self, inner: &mut Inner, index: usize) {
        let slot = &mut inner.slots[index];
        slot.state = State::Loading;
        slot.attempt += 1;
        slot.failure = None;
        tracing::info!(target: "kiln::serve", model = %slot.entry.alias, "loading {} from {}", slot.entry.alias, slot.entry.source);
        let started = self
            .spawn
            .get()
            .ok_or_else(|| "the server is not serving yet".to_string())
            .and_then(|spawn| spawn(index).map_err(|e| format!("starting its thread: {e}")));
        if let Err(why) = started {
            slot.state = State::Unloaded;
            slot.failure = Some((slot.attempt, why));
        }
    }

    /// Its engine thread has loaded the model at `index` in `took`, holding `bytes`.
    pub fn loaded(&self, index: usize, ready: Arc<Ready>, bytes: u64, took: Duration) {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let slot = &mut inner.slots[index];
        slot.bytes = bytes;
        slot.loads += 1;
        slot.load_time = took;
        slot.last_used = Instant::now();
        slot.created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        tracing::info!(
            target: "kiln::serve",
            model = %slot.entry.alias,
            mib = bytes >> 20,
            load_ms = took.as_millis() as u64,
            "loaded {} in {:.1} s ({} MiB of weights and KV cache)",
            slot.entry.alias,
            took.as_secs_f64(),
            bytes >> 20
        );
        if inner.shutting_down {
            let _ = ready.commands.send(Command::Shutdown);
            slot.state = State::Unloading;
        } else {
            slot.state = State::Loaded(ready);
            // The estimate may have been short: trim what is over the limits now.
            self.trim(inner, Some(index));
        }
        drop(guard);
        self.changed.notify_waiters();
        self.stopped.notify_all();
    }

    /// Unloads idle models, least recently used first, while the loaded ones exceed the
    /// limits (never `keep`).
    fn trim(&self, inner: &mut Inner, keep: Option<usize>) {
        loop {
            let (held, count) = inner.held();
            // One model alone over the budget stays: unloading it would only load it again.
            let over = count > 1 && !self.within(held, count);
            match inner.idle(keep).first().copied() {
                Some(i) if over => {
                    Self::begin_unload(&mut inner.slots[i], Some("to stay within the limits"));
                }
                _ => return,
            }
        }
    }

    /// Loading the model at `index` failed.
    pub fn load_failed(&self, index: usize, why: String) {
        self.ended(index, |slot| {
            tracing::error!(target: "kiln::serve", model = %slot.entry.alias, error = %why, "loading {} failed", slot.entry.alias);
            slot.failure = Some((slot.attempt, why));
        });
    }

    /// The engine thread of the model at `index` has stopped and freed it.
    pub fn unloaded(&self, index: usize) {
        self.ended(index, |slot| {
            tracing::info!(target: "kiln::serve", model = %slot.entry.alias, "unloaded {}", slot.entry.alias);
            slot.unloads += 1;
        });
    }

    /// The engine thread of the model at `index` panicked (while loading or serving it): it
    /// is unloaded, and the requests waiting on its load get 503.
    pub fn crashed(&self, index: usize) {
        self.ended(index, |slot| {
            tracing::error!(target: "kiln::serve", model = %slot.entry.alias, "the engine thread of {} panicked; the model is unloaded", slot.entry.alias);
            slot.failure = Some((slot.attempt, "its engine thread panicked".into()));
        });
    }

    /// The engine thread of the model at `index` has ended: the model is unloaded, `record`
    /// says how, and whoever waits on a model's state is woken.
    fn ended(&self, index: usize, record: impl FnOnce(&mut Slot)) {
        let mut inner = self.lock();
        let slot = &mut inner.slots[index];
        slot.state = State::Unloaded;
        record(slot);
        drop(inner);
        self.changed.notify_waiters();
        self.stopped.notify_all();
    }

    fn set_keep_alive(&self, index: usize, keep: Option<Duration>) {
        let mut inner = self.lock();
        inner.slots[index].expires = keep.map(|keep| Instant::now() + keep);
    }

    /// When the model at `index` unloads once idle (`None`: not on a timer).
    pub fn expires(&self, index: usize) -> Option<Instant> {
        self.lock().slots[index].expires
    }

    /// Unloads the model at `index` if its keep-alive has run out and no request holds it;
    /// otherwise, if it is idle on a timer, checks again when the timer runs out. One timer
    /// per model is pending at a time (a busy server's requests each end here), and it wakes
    /// at least daily, so a keep-alive of years never sleeps past what the runtime's timer
    /// takes.
    fn expire(self: &Arc<Self>, index: usize) {
        const MOST_SLEEP: Duration = Duration::from_secs(86_400);
        let mut inner = self.lock();
        if inner.shutting_down {
            return;
        }
        let slot = &mut inner.slots[index];
        let (Some(expires), 0, State::Loaded(_)) = (slot.expires, slot.leases, &slot.state) else {
            return;
        };
        let now = Instant::now();
        if expires <= now {
            slot.expires = None;
            Self::begin_unload(slot, Some("because its keep_alive ran out"));
            return;
        }
        let wake = expires.min(now + MOST_SLEEP);
        if slot.timer.is_some_and(|armed| armed <= wake) {
            return;
        }
        // A timer needs the runtime; without one (a test) the next release checks again.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        slot.timer = Some(wake);
        drop(inner);
        let fleet = self.clone();
        runtime.spawn(async move {
            tokio::time::sleep_until(wake.into()).await;
            {
                let mut inner = fleet.lock();
                let slot = &mut inner.slots[index];
                if slot.timer == Some(wake) {
                    slot.timer = None;
                }
            }
            fleet.expire(index);
        });
    }

    /// A lease on the model at `index` ended.
    fn release(self: &Arc<Self>, index: usize) {
        self.release_lease(index);
        self.expire(index);
    }

    fn release_lease(&self, index: usize) {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let slot = &mut inner.slots[index];
        slot.leases = slot.leases.saturating_sub(1);
        slot.last_used = Instant::now();
        // Over the limits (a model turned out larger than its estimate while others were
        // busy): an idle one goes now.
        if !inner.shutting_down {
            self.trim(inner, None);
        }
        drop(guard);
        // A load waiting for this model to become idle may go on.
        self.changed.notify_waiters();
    }

    /// Stops taking requests and tells every loaded model's engine thread to finish what runs
    /// (within the grace period) and stop.
    pub fn shutdown(&self) {
        let mut inner = self.lock();
        inner.shutting_down = true;
        // A model still loading is stopped by `loaded` when it is done.
        for slot in &mut inner.slots {
            if matches!(slot.state, State::Loaded(_)) {
                Self::begin_unload(slot, None);
            }
        }
        drop(inner);
        self.changed.notify_waiters();
        // With no model loaded (each unloaded when idle), no engine thread will end to wake
        // `wait_stopped`: wake it here.
        self.stopped.notify_all();
    }

    /// Whether the server is stopping ([`Fleet::shutdown`] was called): no new work.
    pub fn stopping(&self) -> bool {
        self.lock().shutting_down
    }

    /// Blocks until [`Fleet::shutdown`] was called and every engine thread has stopped.
    pub fn wait_stopped(&self) {
        let mut inner = self.lock();
        while !(inner.shutting_down && inner.slots.iter().all(|s| !s.state.holds_memory())) {
            inner = self.stopped.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// How many models it serves (loaded or not).
    pub fn count(&self) -> usize {
        self.lock().slots.len()
    }

    /// The model at `index`, when it is loaded.
    pub fn loaded_model(&self, index: usize) -> Option<Arc<Ready>> {
        match &self.lock().slots[index].state {
            State::Loaded(ready) => Some(ready.clone()),
            _ => None,
        }
    }

    /// The entry of the model at `index`, and the bytes it holds (or is expected to).
    pub fn entry(&self, index: usize) -> (ModelEntry, u64) {
        let inner = self.lock();
        let slot = &inner.slots[index];
        (slot.entry.clone(), slot.bytes)
    }

    /// The index of the model `name` picks (as [`Fleet::acquire`] would).
    ///
    /// # Errors
    /// 404 for a name no model has.
    pub fn index_of(&self, name: Option<&str>) -> Result<usize, ApiError> {
        Self::find(&self.lock(), name)
    }

    /// Every model, in the order given.
    pub fn list(&self) -> Vec<Listed> {
        self.lock()
            .slots
            .iter()
            .map(|s| Listed {
                alias: s.entry.alias.clone(),
                state: s.state.name(),
                created: s.created,
                max_model_len: match &s.state {
                    State::Loaded(ready) => Some(ready.shape.max_positions),
                    _ => None,
                },
            })
            .collect()
    }

    /// The fleet's Prometheus lines: each model's state, loads, unloads, last load time and
    /// memory, and the budget.
    pub fn render_metrics(&self, out: &mut String) {
        let inner = self.lock();
        type Value = fn(&Slot) -> f64;
        let families: [(&str, &str, &str, Value); 5] = [
            (
                "kiln_model_loaded",
                "gauge",
                "1 while the model is loaded.",
                |s| f64::from(u8::from(matches!(s.state, State::Loaded(_)))),
            ),
            (
                "kiln_model_loads_total",
                "counter",
                "Times the model was loaded.",
                |s| s.loads as f64,
            ),
            (
                "kiln_model_unloads_total",
                "counter",
                "Times the model was unloaded (to make room, or at shutdown).",
                |s| s.unloads as f64,
            ),
            (
                "kiln_model_load_seconds",
                "gauge",
                "How long the model's last load took.",
                |s| s.load_time.as_secs_f64(),
            ),
            (
                "kiln_model_memory_bytes",
                "gauge",
                "Bytes the model holds when loaded (weights and KV cache; the files' size before its first load).",
                |s| s.bytes as f64,
            ),
        ];
        for (name, kind, help, value) in families {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for slot in &inner.slots {
                let _ = writeln!(
                    out,
                    "{name}{{model=\"{}\"}} {}",
                    slot.entry.alias,
                    value(slot)
                );
            }
        }
        if let Some(budget) = self.limits.memory_bytes {
            let name = "kiln_models_memory_budget_bytes";
            let _ = writeln!(
                out,
                "# HELP {name} Most bytes the loaded models may hold together (--models-memory-mb).\n# TYPE {name} gauge\n{name} {budget}"
            );
        }
    }
}

/// Whether `alias` may name a model: 1-64 letters, digits and `._:-` (safe in a URL, a log
/// field and a Prometheus label).
fn valid_alias(alias: &str) -> bool {
    (1..=64).contains(&alias.len())
        && alias
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn fleet_whose_threads(then: fn(&Fleet, usize)) -> Arc<Fleet> {
        let entry = |alias: &str| ModelEntry {
            alias: alias.into(),
            source: "nowhere".into(),
            estimated_bytes: 1,
        };
        let fleet =
            Arc::new(Fleet::new(vec![entry("a"), entry("b")], FleetLimits::default()).unwrap());
        let weak = Arc::downgrade(&fleet);
        fleet.set_spawner(Box::new(move |index| {
            let fleet = weak.upgrade().unwrap();
            std::thread::spawn(move || then(&fleet, index));
            Ok(())
        }));
        fleet
    }

    #[test]
    fn a_load_that_fails_or_panics_is_an_error_and_leaves_the_model_unloaded() {
        let failing = fleet_whose_threads(|f, i| f.load_failed(i, "corrupt file".into()));
        assert_eq!(failing.load_blocking(0), Err("corrupt file".to_string()));
        let crashing = fleet_whose_threads(Fleet::crashed);
        assert_eq!(
            crashing.load_blocking(1),
            Err("its engine thread panicked".to_string())
        );
        for fleet in [failing, crashing] {
            assert!(!fleet.started());
            assert!(fleet.list().iter().all(|m| m.state == "unloaded"));
            // Nothing holds memory: a stop does not wait.
            fleet.shutdown();
            fleet.wait_stopped();
        }
    }

    #[test]
    fn a_stop_wakes_a_waiter_when_no_model_is_loaded() {
        // Every model unloaded while serving (a keep_alive of 0): the server waits in
        // `wait_stopped` before the signal comes, and no engine thread ends after it.
        let fleet = fleet_whose_threads(|f, i| f.load_failed(i, "never loaded".into()));
        let (done, stopped) = std::sync::mpsc::channel();
        let waiter = fleet.clone();
        std::thread::spawn(move || {
            waiter.wait_stopped();
            done.send(()).unwrap();
        });
        std::thread::sleep(Duration::from_millis(50));
        fleet.shutdown();
        assert!(stopped.recv_timeout(Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn aliases_are_short_plain_names() {
        for good in ["smol", "qwen3:8b", "llama-3.1_8B.Q4_K_M"] {
            assert!(valid_alias(good), "{good}");
        }
        let long = "x".repeat(65);
        for bad in ["", "a b", "a/b", "a\"b", "é", long.as_str()] {
            assert!(!valid_alias(bad), "{bad}");
        }
    }
}
