//! A small persistent thread pool for the kernels: one job at a time, split into tasks that
//! every thread (the caller included) claims from an atomic counter.
//!
//! Why not rayon: a decode step runs ~200 matrix products, many of them a few microseconds of
//! memory traffic. Waking a sleeping rayon worker costs about as much as the product itself,
//! so the workers here spin for a short while after each job ([`SPIN`]) and only then sleep
//! on a condition variable; a decode step therefore pays at most one wake-up. The pool never
//! runs two jobs at once: callers on other threads queue on a mutex, and a job started from
//! inside a job runs inline on the calling thread.
//!
//! A job is either `tasks` indices claimed one at a time from a counter ([`ThreadPool::run`]),
//! or a range split into one share a thread, each walked from its front and finished from
//! the others' backs ([`ThreadPool::run_split`]: a decode step's products, whose threads
//! then end within one claim of each other and each stream one run of weights).
//!
//! The process-wide pool ([`ThreadPool::global`]) is sized once, at start-up: by
//! [`ThreadPool::init_global`] with the count the program was given (`kiln --threads N`), or,
//! when nothing sized it before the first kernel ran, by [`default_threads`] (`KILN_THREADS`,
//! else one thread per core).

use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The environment variable that sizes the pool when the program does not
/// ([`ThreadPool::init_global`]); default: every core.
pub const THREADS_ENV: &str = "KILN_THREADS";

/// The process-wide pool, built once.
static GLOBAL: OnceLock<ThreadPool> = OnceLock::new();

/// How long an idle worker keeps spinning before it sleeps.
pub const SPIN: Duration = Duration::from_micros(300);

/// The task function of the running job, as the workers see it.
type TaskFn<'a> = &'a (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped (under no lock) when a job is published; workers compare it with what they saw.
    epoch: AtomicUsize,
    /// The job: valid from the epoch bump until `active` falls to 0.
    job: UnsafeCell<Option<TaskFn<'static>>>,
    /// Tasks in the job, and the next one to claim.
    tasks: AtomicUsize,
    next: AtomicUsize,
    /// Workers that have not finished the current job yet.
    active: AtomicUsize,
    /// A task panicked.
    panicked: AtomicBool,
    /// Tasks run by worker threads (not the caller) since the pool started.
    worker_tasks: AtomicUsize,
    /// Workers asleep on `wake`, and the lock they sleep under.
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the one thread holding `ThreadPool::submit` while every
// worker is idle (`active == 0`), and read by workers only between the epoch bump that
// publishes it and their decrement of `active`.
unsafe impl Sync for Shared {}

/// A pool of `threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    threads: usize,
    submit: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads)
            .finish()
    }
}

thread_local! {
    /// Whether this thread is running a task of some pool (nested jobs run inline).
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

impl ThreadPool {
    /// A pool running jobs on `threads` threads (the caller and `threads - 1` workers).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            worker_tasks: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads)
            .filter_map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("kiln-kernel-{i}"))
                    .spawn(move || worker(&shared))
                    .ok()
            })
            .collect::<Vec<_>>();
        let threads = workers.len() + 1;
        Self {
            shared,
            threads,
            submit: Mutex::new(()),
            workers,
        }
    }

    /// The process-wide pool the kernels run on: as [`init_global`](Self::init_global) built
    /// it, or, if nothing did before this first call, [`default_threads`] threads.
    pub fn global() -> &'static ThreadPool {
        GLOBAL.get_or_init(|| ThreadPool::new(default_threads()))
    }

    /// Builds the process-wide pool with `threads` threads (at least 1): the program's thread
    /// count, set once at start-up before any kernel runs. Asking again for the count the pool
    /// already has is not an error.
    ///
    /// # Errors
    /// [`ThreadsAlreadySet`] when the pool was already built with another count (an earlier
    /// call, or a kernel that ran first and sized it by [`default_threads`]).
    pub fn init_global(threads: usize) -> Result<&'static ThreadPool, ThreadsAlreadySet> {
        let threads = threads.max(1);
        let mut built = false;
        let pool = GLOBAL.get_or_init(|| {
            built = true;
            ThreadPool::new(threads)
        });
        // A pool that could not spawn every worker runs on fewer threads: what it has is what
        // was asked for when it was built here.
        if built || pool.threads == threads {
            Ok(pool)
        } else {
            Err(ThreadsAlreadySet {
                running: pool.threads,
                asked: threads,
            })
        }
    }

    /// Threads a job runs on, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Tasks that ran on worker threads rather than the caller, since the pool started: how a
    /// test or `kiln selftest` sees that a job really was spread over threads.
    pub fn worker_tasks(&self) -> usize {
        self.shared.worker_tasks.load(Ordering::Relaxed)
    }

    /// Runs `task(i)` for every `i < tasks`, spread over the pool's threads, and returns when
    /// all have finished. Tasks are claimed in increasing order.
    ///
    /// # Panics
    /// Re-raises (as a new panic) a panic from any task, after every task has stopped.
    pub fn run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if tasks == 1 || self.threads == 1 || IN_TASK.with(Cell::get) {
            (0..tasks).for_each(task);
            return;
        }
        let _one_job = self
            .submit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let shared = &*self.shared;
        // SAFETY: the lifetime is erased only for the duration of this call: we wait below
        // until every worker has left the job (`active == 0`) before returning, and no worker
        // reads `job` outside that window.
        let erased: TaskFn<'static> = unsafe { std::mem::transmute::<TaskFn<'_>, _>(task) };
        // SAFETY: we hold `submit`, so no other caller writes `job`, and every worker is idle
        // (`active` is 0 between jobs): none reads it until the epoch bump below publishes it.
        unsafe { *shared.job.get() = Some(erased) };
        shared.tasks.store(tasks, Ordering::Relaxed);
        shared.next.store(0, Ordering::Relaxed);
        shared.panicked.store(false, Ordering::Relaxed);
        shared.active.store(self.workers.len(), Ordering::SeqCst);
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        if shared.sleeping.load(Ordering::SeqCst) > 0 {
            let _guard = shared
                .lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            shared.wake.notify_all();
        }
        run_tasks(shared, task, false);
        while shared.active.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        // SAFETY: `active` is 0: every worker has left the job and none reads `job` until the
        // next epoch bump; we still hold `submit`.
        unsafe { *shared.job.get() = None };
        if shared.panicked.load(Ordering::Relaxed) {
            panic!("a kernel task panicked");
        }
    }

    /// Runs `work` over every index of `0..len` exactly once, in claims of at most `step`
    /// indices, and returns when all have run. Each thread owns an equal share, which it
    /// walks from the front (one run of adjacent indices, which for a matrix's rows is one
    /// stream of weights the prefetchers follow); a thread done with its share takes claims
    /// from the back of the others', so that the threads finish within one claim of each
    /// other. (Tasks claimed from one counter end as unevenly as one task's length, and
    /// shorter tasks start a new stream each.)
    ///
    /// # Panics
    /// As [`run`](Self::run); and if `step` is 0 or `len` does not fit 32 bits.
    pub fn run_split(&self, len: usize, step: usize, work: &(dyn Fn(Range<usize>) + Sync)) {
        assert!(step > 0, "claims of no index");
        if len == 0 {
            return;
        }
        let shares = self.threads.min(len.div_ceil(step));
        if shares == 1 || IN_TASK.with(Cell::get) {
            work(0..len);
            return;
        }
        let shares: Vec<TwoEnded> = (0..shares)
            .map(|s| TwoEnded::new(len * s / shares..len * (s + 1) / shares))
            .collect();
        self.run(shares.len(), &|own| {
            while let Some(claim) = shares[own].claim_front(step) {
                work(claim);
            }
            for other in (1..shares.len()).map(|i| (own + i) % shares.len()) {
                while let Some(claim) = shares[other].claim_back(step) {
                    work(claim);
                }
            }
        });
    }
}

/// A range of indices claimed from both ends: by its owner from the front, by other threads
/// from the back. Both ends live in one word (front in the high half), so that a claim is
/// one compare-and-swap and the two ends never cross. Each range has a pair of cache lines to
/// itself: side by side, an owner's every claim took the line from the thread claiming its
/// own range beside it (the pair, because the hardware fetches lines in pairs).
#[repr(align(128))]
struct TwoEnded(AtomicU64);

impl TwoEnded {
    fn new(range: Range<usize>) -> Self {
        let (front, back) = (
            u32::try_from(range.start).expect("a share's start fits 32 bits"),
            u32::try_from(range.end).expect("a share's end fits 32 bits"),
        );
        Self(AtomicU64::new(Self::pack(front, back)))
    }

    fn pack(front: u32, back: u32) -> u64 {
        (u64::from(front) << 32) | u64::from(back)
    }

    /// The next at most `step` indices from the front; `None` once the range is empty.
    fn claim_front(&self, step: usize) -> Option<Range<usize>> {
        self.claim(|front, back| {
            let end = front
                .saturating_add(u32::try_from(step).unwrap_or(u32::MAX))
                .min(back);
            (Self::pack(end, back), front..end)
        })
    }

    /// The last at most `step` indices; `None` once the range is empty.
    fn claim_back(&self, step: usize) -> Option<Range<usize>> {
        self.claim(|front, back| {
            let start = back
                .saturating_sub(u32::try_from(step).unwrap_or(u32::MAX))
                .max(front);
            (Self::pack(front, start), start..back)
        })
    }

    /// Takes what `take` carves out of the non-empty range (front, back): the new word and
    /// the claim.
    fn claim(&self, take: impl Fn(u32, u32) -> (u64, Range<u32>)) -> Option<Range<usize>> {
        let mut word = self.0.load(Ordering::Relaxed);
        loop {
            let (front, back) = ((word >> 32) as u32, word as u32);
            if front >= back {
                return None;
            }
            let (new, claim) = take(front, back);
            // Relaxed: the claim is all a thread learns from the word; the indices' results
            // reach the caller through `run`'s end of job.
            match self
                .0
                .compare_exchange_weak(word, new, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(claim.start as usize..claim.end as usize),
                Err(now) => word = now,
            }
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _guard = self
                .shared
                .lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The thread count when the program names none: `KILN_THREADS` if it is a positive number,
/// else the number of cores ([`std::thread::available_parallelism`]).
pub fn default_threads() -> usize {
    threads_from_env(std::env::var(THREADS_ENV).ok().as_deref())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A positive thread count from `KILN_THREADS`'s value; `None` for anything else.
fn threads_from_env(value: Option<&str>) -> Option<usize> {
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

/// [`ThreadPool::init_global`] came after the process-wide pool was built with another count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the kernel thread pool runs {running} threads, and {asked} were asked for after it started"
)]
pub struct ThreadsAlreadySet {
    /// Threads the pool has.
    pub running: usize,
    /// Threads asked for.
    pub asked: usize,
}

/// Claims and runs tasks until none is left.
fn run_tasks(shared: &Shared, task: &(dyn Fn(usize) + Sync), on_worker: bool) {
    let tasks = shared.tasks.load(Ordering::Relaxed);
    IN_TASK.with(|t| t.set(true));
    loop {
        let i = shared.next.fetch_add(1, Ordering::Relaxed);
        if i >= tasks {
            break;
        }
        if on_worker {
            shared.worker_tasks.fetch_add(1, Ordering::Relaxed);
        }
        if catch_unwind(AssertUnwindSafe(|| task(i))).is_err() {
            shared.panicked.store(true, Ordering::Relaxed);
        }
    }
    IN_TASK.with(|t| t.set(false));
}

fn worker(shared: &Shared) {
    // Epoch 0 is "no job yet", whenever this thread starts: reading the counter here instead
    // would miss a job published before the thread ran.
    let mut seen = 0;
    loop {
        // Spin a while for the next job, then sleep until one is published.
        let idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            if shared.shutdown.load(Ordering::Relaxed) {
                return;
            }
            if shared.epoch.load(Ordering::SeqCst) != seen {
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && idle_since.elapsed() > SPIN {
                let mut guard = shared
                    .lock
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                shared.sleeping.fetch_add(1, Ordering::SeqCst);
                while shared.epoch.load(Ordering::SeqCst) == seen
                    && !shared.shutdown.load(Ordering::SeqCst)
                {
                    guard = shared
                        .wake
                        .wait(guard)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                shared.sleeping.fetch_sub(1, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        }
        seen = shared.epoch.load(Ordering::SeqCst);
        // SAFETY: the job was stored before the epoch bump we just saw, and stays valid until
        // we decrement `active`.
        if let Some(task) = unsafe { *shared.job.get() } {
            run_tasks(shared, task, true);
        }
        shared.active.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_jobs() {
        let pool = ThreadPool::new(3);
        for tasks in [0, 1, 2, 7, 64, 1000] {
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn jobs_after_the_workers_slept_still_run() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(SPIN * 4);
        let sum = AtomicUsize::new(0);
        pool.run(100, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }

    #[test]
    fn nested_jobs_run_inline_and_callers_on_other_threads_wait_their_turn() {
        let pool = Arc::new(ThreadPool::new(2));
        let total = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (Arc::clone(&pool), Arc::clone(&total));
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        pool.run(4, &|_| {
                            pool.run(3, &|_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("caller thread");
        }
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 4 * 3);
    }

    #[test]
    fn the_global_pool_is_sized_once_and_keeps_its_size() {
        // Another test of this binary may have run a kernel first, building the pool at its
        // default size: then that is the size it keeps.
        let running = match ThreadPool::init_global(3) {
            Ok(pool) => {
                assert_eq!(pool.threads(), 3);
                3
            }
            Err(e) => e.running,
        };
        let pool = ThreadPool::global();
        assert_eq!(pool.threads(), running);
        let again = ThreadPool::init_global(running).expect("the same count again");
        assert!(std::ptr::eq(again, pool));
        assert_eq!(
            ThreadPool::init_global(running + 1).unwrap_err(),
            ThreadsAlreadySet {
                running,
                asked: running + 1
            }
        );
    }

    #[test]
    fn kiln_threads_counts_only_when_positive() {
        assert_eq!(threads_from_env(Some(" 4 ")), Some(4));
        for value in [None, Some("0"), Some("-1"), Some("many"), Some("")] {
            assert_eq!(threads_from_env(value), None, "{value:?}");
        }
    }

    #[test]
    fn run_split_runs_every_index_once() {
        let pool = ThreadPool::new(3);
        for (len, step) in [
            (1, 1),
            (2, 1),
            (7, 2),
            (64, 2),
            (65, 3),
            (1000, 7),
            (5, 100),
        ] {
            let counts: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
            pool.run_split(len, step, &|claim| {
                assert!(
                    !claim.is_empty() && claim.len() <= step,
                    "{claim:?} of step {step}"
                );
                for i in claim {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                "len {len}, step {step}"
            );
        }
        // Nested inside a task it runs inline, still every index once.
        let total = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run_split(10, 3, &|claim| {
                total.fetch_add(claim.len(), Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 40);
    }

    #[test]
    fn two_ended_claims_meet_without_overlap() {
        let range = TwoEnded::new(10..21);
        assert_eq!(range.claim_front(4), Some(10..14));
        assert_eq!(range.claim_back(4), Some(17..21));
        assert_eq!(range.claim_back(4), Some(14..17));
        assert_eq!(range.claim_front(4), None);
        assert_eq!(range.claim_back(1), None);
        // Claimed from both ends by many threads at once: every index once.
        let range = TwoEnded::new(0..100_000);
        let counts: Vec<AtomicUsize> = (0..100_000).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|scope| {
            for t in 0..4 {
                let (range, counts) = (&range, &counts);
                scope.spawn(move || {
                    loop {
                        let claim = if t % 2 == 0 {
                            range.claim_front(3)
                        } else {
                            range.claim_back(5)
                        };
                        let Some(claim) = claim else { break };
                        for i in claim {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| assert!(i != 5, "task 5 fails"));
        }));
        assert!(caught.is_err());
        let ran = AtomicUsize::new(0);
        pool.run(8, &|_| {
            ran.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(ran.load(Ordering::Relaxed), 8);
    }
}
