//! The checker's vocabulary: monotonic instants, windows, and intervals of protected work.

/// `CLOCK_MONOTONIC` nanoseconds: the same clock in every process on this machine.
pub type Ns = u128;

/// Nanoseconds per millisecond.
pub const MS: Ns = 1_000_000;

/// Now, by `CLOCK_MONOTONIC` (the clock the workers write in their logs).
pub fn now_ns() -> Ns {
    leasehold_testkit::monotonic_ns()
}

/// A span of time `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// First instant.
    pub start: Ns,
    /// First instant after.
    pub end: Ns,
}

impl Window {
    /// The window from `start` to `end`.
    pub fn new(start: Ns, end: Ns) -> Window {
        Window { start, end }
    }

    /// Whether `t` falls inside.
    pub fn contains(&self, t: Ns) -> bool {
        self.start <= t && t < self.end
    }
}

/// One stretch of protected work, as a worker recorded it (or as its death ended it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interval {
    /// Worker slot (0..workers).
    pub worker: usize,
    /// Incarnation of that worker (bumped on every respawn).
    pub generation: u32,
    /// The task id.
    pub id: String,
    /// When the work started (after the grant).
    pub start: Ns,
    /// When it stopped.
    pub end: Ns,
    /// Granted by the backend-down policy without Redis (fencing token 0).
    pub local: bool,
    /// `completed`, `cancelled`, `lost-*`, `killed` (the process was SIGKILLed while working),
    /// or `open` (no end recorded and no kill known: a checker error).
    pub outcome: String,
}

/// A SIGKILL the test sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kill {
    /// Worker slot.
    pub worker: usize,
    /// The incarnation that died.
    pub generation: u32,
    /// When the test saw it dead.
    pub at: Ns,
}

/// A cancel the test issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancel {
    /// The task id.
    pub id: String,
    /// When the call was made.
    pub at: Ns,
}

/// A small seeded generator (xorshift64*), so that a run can be replayed from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15 | 1)
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
