//! `numpy.random.RandomState`'s generator, bit for bit, as far as Megatron's dataset indices
//! use it: legacy seeding from a 32-bit integer, MT19937, and the legacy `shuffle` of a 1-D
//! array.
//!
//! Follows numpy 2.x (unchanged since numpy 1.17): `numpy/random/_mt19937.pyx`
//! (`MT19937._legacy_seeding`, which calls `mt19937_seed`), `src/mt19937/mt19937.c`
//! (`mt19937_seed`, `mt19937_gen`) and `mt19937.h` (`mt19937_next`, the tempering, and
//! `mt19937_next64` = first draw in the high word), `src/distributions/distributions.c`
//! (`random_interval`: the smallest all-ones mask covering the bound, then rejection of
//! masked 32-bit draws, or of 64-bit draws above `0xFFFF_FFFF`), and `mtrand.pyx`
//! (`RandomState.shuffle` → `_shuffle_raw`: Fisher–Yates from the last element down, swapping
//! `i` with `random_interval(i)`).

/// State words of MT19937.
const N: usize = 624;
/// The twist offset.
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// numpy's legacy `RandomState(seed)` generator (MT19937).
#[derive(Clone)]
pub struct RandomState {
    key: [u32; N],
    pos: usize,
}

impl std::fmt::Debug for RandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RandomState")
            .field("pos", &self.pos)
            .finish_non_exhaustive()
    }
}

impl RandomState {
    /// `numpy.random.RandomState(seed)` for an integer seed (numpy accepts `0..2**32`).
    pub fn new(seed: u32) -> Self {
        let mut key = [0u32; N];
        let mut value = seed;
        for (pos, slot) in key.iter_mut().enumerate() {
            *slot = value;
            value = 1_812_433_253u32
                .wrapping_mul(value ^ (value >> 30))
                .wrapping_add(pos as u32 + 1);
        }
        Self { key, pos: N }
    }

    /// Regenerates the 624 state words (`mt19937_gen`).
    fn generate(&mut self) {
        let twist = |upper: u32, lower: u32, far: u32| {
            let y = (upper & UPPER_MASK) | (lower & LOWER_MASK);
            far ^ (y >> 1) ^ (0u32.wrapping_sub(y & 1) & MATRIX_A)
        };
        for i in 0..N - M {
            self.key[i] = twist(self.key[i], self.key[i + 1], self.key[i + M]);
        }
        for i in N - M..N - 1 {
            self.key[i] = twist(self.key[i], self.key[i + 1], self.key[i + M - N]);
        }
        self.key[N - 1] = twist(self.key[N - 1], self.key[0], self.key[M - 1]);
        self.pos = 0;
    }

    /// The next 32-bit output (`mt19937_next32`; `RandomState._bit_generator.random_raw()`).
    pub fn next_u32(&mut self) -> u32 {
        if self.pos >= N {
            self.generate();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// The next 64-bit output: two 32-bit draws, the first in the high word (`mt19937_next64`).
    pub fn next_u64(&mut self) -> u64 {
        let high = u64::from(self.next_u32());
        (high << 32) | u64::from(self.next_u32())
    }

    /// A uniform integer in `0..=max` by masked rejection (`random_interval`).
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mask = u64::MAX >> max.leading_zeros();
        if max <= u64::from(u32::MAX) {
            loop {
                let value = u64::from(self.next_u32()) & mask;
                if value <= max {
                    return value;
                }
            }
        }
        loop {
            let value = self.next_u64() & mask;
            if value <= max {
                return value;
            }
        }
    }

    /// Shuffles `values` in place as `RandomState.shuffle` shuffles a 1-D array.
    pub fn shuffle<T>(&mut self, values: &mut [T]) {
        for i in (1..values.len()).rev() {
            // `j <= i < values.len()`, so the conversion back to usize is lossless.
            let j = self.random_interval(i as u64) as usize;
            values.swap(i, j);
        }
    }
}
