//! The threads the CPU backends compute on: one count for kiln's kernel pool
//! ([`kiln_kernels::ThreadPool`]: quantized and f32 products, attention, the row kernels) and for
//! rayon's global pool (burn-flex's other operations, its matmuls through `gemm` included).
//!
//! The count is a value the program sets once at start-up ([`set_threads`], from
//! `kiln --threads N`), before any tensor exists: rayon's pool cannot be resized once built, and
//! the kernel pool is built by its first job. When nothing sets it, each pool is built at its
//! first use with [`default_threads`]: `KILN_THREADS` if it is a positive number, else one
//! thread per core.

use std::fmt;

use crate::error::{CoreError, Result};

pub use kiln_kernels::pool::{THREADS_ENV, default_threads};

/// The threads each CPU pool runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadCounts {
    /// kiln's kernel pool, the calling thread included.
    pub kernels: usize,
    /// rayon's global pool, which burn-flex's operations run on (`None`: the cpu backend is
    /// not compiled in).
    pub flex: Option<usize>,
}

impl fmt::Display for ThreadCounts {
    /// `2 threads` when the pools agree, else each pool's count.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        match self.flex {
            Some(flex) if flex != self.kernels => write!(
                f,
                "{} kernel thread{}, {flex} burn-flex thread{}",
                self.kernels,
                plural(self.kernels),
                plural(flex)
            ),
            _ => write!(f, "{} thread{}", self.kernels, plural(self.kernels)),
        }
    }
}

/// Sizes the kernel pool and rayon's global pool to `threads` (`None`: [`default_threads`])
/// and returns the counts they run. Call once at start-up, before any tensor exists; calling
/// again with the same count changes nothing.
///
/// # Errors
/// [`CoreError::Threads`] when a pool was already built with another count (an earlier call,
/// or work that ran before this one), or rayon could not start its threads.
pub fn set_threads(threads: Option<usize>) -> Result<ThreadCounts> {
    let threads = threads.unwrap_or_else(default_threads).max(1);
    let kernels = kiln_kernels::ThreadPool::init_global(threads)
        .map_err(|e| CoreError::Threads(e.to_string()))?
        .threads();
    #[cfg(feature = "cpu")]
    let flex = Some(size_rayon(threads)?);
    #[cfg(not(feature = "cpu"))]
    let flex = None;
    Ok(ThreadCounts { kernels, flex })
}

/// The threads each pool runs now, building a pool nothing has sized yet at its default size
/// (so that what is reported is what will run).
pub fn in_use() -> ThreadCounts {
    ThreadCounts {
        kernels: kiln_kernels::ThreadPool::global().threads(),
        #[cfg(feature = "cpu")]
        flex: Some(rayon::current_num_threads()),
        #[cfg(not(feature = "cpu"))]
        flex: None,
    }
}

/// Builds rayon's global pool with `threads` threads, or checks that the one already built has
/// as many.
#[cfg(feature = "cpu")]
fn size_rayon(threads: usize) -> Result<usize> {
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("kiln-flex-{i}"))
        .build_global();
    // `current_num_threads` on a thread outside any pool reports the global pool.
    let running = rayon::current_num_threads();
    match built {
        Ok(()) => Ok(running),
        Err(_) if running == threads => Ok(running),
        Err(e) => Err(CoreError::Threads(format!(
            "burn-flex's thread pool runs {running} threads, and {threads} were asked for after \
             it started ({e})"
        ))),
    }
}
