//! Layer 0 of `amprobe::LAYERS`: uses no other module of the crate.
//!
//! A small deterministic random number generator (SplitMix64), stable across versions, for
//! seeded synthetic data, dropout masks and tests.

/// SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng {
            state: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// A generator for a stream derived from a seed and several keys (step, op index, ...).
    pub fn derive(seed: u64, keys: &[u64]) -> Rng {
        let mut r = Rng::new(seed);
        for &k in keys {
            r.state ^= k.wrapping_mul(0xD1B5_4A32_D192_ED03);
            r.next_u64();
        }
        r
    }

    /// The generator's state: draw k (from 1) is the SplitMix64 mix of
    /// `state + k·0x9E3779B97F4A7C15`, so a device kernel can draw element k directly.
    pub fn state(&self) -> u64 {
        self.state
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}
