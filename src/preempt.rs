//! Ending a training job cleanly before its last step: a scheduler's preemption signal
//! (Slurm sends `SIGTERM` before it kills a job; Megatron's `--exit-signal-handler`), a
//! wall-clock budget (`--exit-duration-in-mins`) or a step interval (`--exit-interval`).
//!
//! A signal only sets a flag ([`ExitSignals::flag`]); the training loop reads it after each
//! step and every rank votes in the step's metrics collective, so a signal delivered to one
//! process of a multi-process job (or to all of them at different moments) stops every rank
//! after the same step, which then saves a checkpoint and exits 0 ([`crate::train_job`]). A
//! second signal of the same kind while the first is pending ends the process at once
//! (exit code 1), as a user pressing Ctrl-C twice expects.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use signal_hook::consts::signal::{SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

/// The signals `--exit-signal` accepts, by name.
const SIGNALS: [(&str, i32); 5] = [
    ("TERM", SIGTERM),
    ("INT", SIGINT),
    ("USR1", SIGUSR1),
    ("USR2", SIGUSR2),
    ("HUP", SIGHUP),
];

/// The signal named `name` (`SIGTERM`, `TERM`, `sigterm`, … of TERM, INT, USR1, USR2, HUP).
pub fn parse_signal(name: &str) -> Result<i32, String> {
    let upper = name.trim().to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    SIGNALS
        .iter()
        .find(|(n, _)| *n == bare)
        .map(|&(_, s)| s)
        .ok_or_else(|| {
            let names: Vec<String> = SIGNALS.iter().map(|(n, _)| format!("SIG{n}")).collect();
            format!("unknown signal `{name}` (one of {})", names.join(", "))
        })
}

/// The name (`SIGTERM`, …) of signal number `signal`.
pub fn signal_name(signal: i32) -> String {
    SIGNALS
        .iter()
        .find(|&&(_, s)| s == signal)
        .map_or_else(|| format!("signal {signal}"), |(n, _)| format!("SIG{n}"))
}

/// Handlers of the exit signals of this process; dropping them does not uninstall them.
#[derive(Debug, Clone)]
pub struct ExitSignals {
    flag: Arc<AtomicBool>,
    received: Arc<std::sync::atomic::AtomicI32>,
}

impl ExitSignals {
    /// Installs handlers for `signals`: the first delivery sets the flag, a second delivery of
    /// any of them while it is set ends the process with exit code 1.
    pub fn install(signals: &[i32]) -> std::io::Result<Self> {
        let flag = Arc::new(AtomicBool::new(false));
        let received = Arc::new(std::sync::atomic::AtomicI32::new(0));
        for &signal in signals {
            // Registered first, so it sees the flag as it was before this delivery.
            signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&flag))?;
            signal_hook::flag::register(signal, Arc::clone(&flag))?;
            let received = Arc::clone(&received);
            // SAFETY: the action only stores into an atomic, which is async-signal-safe.
            unsafe {
                signal_hook::low_level::register(signal, move || {
                    received.store(signal, Ordering::SeqCst);
                })?;
            }
        }
        Ok(Self { flag, received })
    }

    /// Set once one of the signals has been delivered.
    pub fn flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.flag)
    }

    /// The last signal delivered, if any.
    pub fn received(&self) -> Option<i32> {
        match self.received.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names_parse_with_or_without_the_prefix() {
        assert_eq!(parse_signal("SIGTERM"), Ok(SIGTERM));
        assert_eq!(parse_signal("term"), Ok(SIGTERM));
        assert_eq!(parse_signal("SIGUSR1"), Ok(SIGUSR1));
        let e = parse_signal("SIGKILL").expect_err("cannot be handled");
        assert!(e.contains("SIGKILL") && e.contains("SIGTERM"), "{e}");
        assert_eq!(signal_name(SIGINT), "SIGINT");
    }

    #[test]
    fn a_delivered_signal_sets_the_flag() {
        let signals = ExitSignals::install(&[SIGUSR2]).expect("install");
        assert!(!signals.flag().load(Ordering::SeqCst));
        signal_hook::low_level::raise(SIGUSR2).expect("raise");
        assert!(signals.flag().load(Ordering::SeqCst));
        assert_eq!(signals.received(), Some(SIGUSR2));
    }
}
