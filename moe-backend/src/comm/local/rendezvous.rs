//! The rendezvous of one group: every member posts its signature and payloads into the slot
//! `(group, sequence number)` and waits for the others (see the parent module docs).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::{Payload, Post, Shared, Signature, Slot};
use crate::comm::CallSite;
use crate::comm::buffer::HostBuffer;
use crate::error::{BackendError, Result};

/// Transport of one group inside a [`World`].
pub(super) struct LocalComm {
    pub(super) shared: Arc<Shared>,
    pub(super) key: Arc<str>,
    pub(super) ranks: Vec<usize>,
    pub(super) index: usize,
    pub(super) seq: AtomicU64,
    pub(super) calls: AtomicU64,
    pub(super) bytes_sent: AtomicU64,
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalComm")
            .field("group", &self.key)
            .field("rank", &self.index)
            .finish()
    }
}

fn describe(sig: &Signature) -> String {
    format!("{} at {}", sig.op, sig.site)
}

impl LocalComm {
    pub(super) fn count(&self, bytes: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(super) fn group(&self) -> String {
        format!("{:?}", self.ranks)
    }

    pub(super) fn me(&self) -> usize {
        self.ranks[self.index]
    }

    pub(super) fn error(&self, op: &'static str, detail: String) -> BackendError {
        BackendError::Collective {
            op,
            group: self.group(),
            detail,
        }
    }

    pub(super) fn aborted(&self, op: &'static str, failure: &(usize, String)) -> BackendError {
        BackendError::Aborted {
            op,
            group: self.group(),
            rank: failure.0,
            reason: failure.1.clone(),
        }
    }

    /// Posts this member's signature and payloads (one per destination member), waits for
    /// every member, and returns every member's signature with the payload sent to this member.
    pub(super) fn exchange(
        &self,
        sig: Signature,
        outgoing: Vec<Option<Payload>>,
    ) -> Result<Vec<(Signature, Option<Payload>)>> {
        let n = self.ranks.len();
        let op = sig.op;
        let site = sig.site;
        let bytes: usize = outgoing
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != self.index)
            .filter_map(|(_, p)| p.as_ref().map(|d| d.bytes().len()))
            .sum();
        self.count(bytes);
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let key = (Arc::clone(&self.key), seq);
        let deadline = Instant::now() + self.shared.config.timeout;
        let mut st = self.shared.lock();
        if let Some(failure) = &st.failure {
            return Err(self.aborted(op, failure));
        }
        let slot = st.slots.entry(key.clone()).or_insert_with(|| Slot {
            posts: (0..n).map(|_| None).collect(),
            readers: 0,
        });
        slot.posts[self.index] = Some(Post { sig, outgoing });
        self.shared.wake.notify_all();
        loop {
            // A complete exchange is read even if a member failed afterwards, so every member
            // reports the same argument check.
            let missing: Vec<usize> = match st.slots.get(&key) {
                Some(slot) => (0..n).filter(|&i| slot.posts[i].is_none()).collect(),
                None => Vec::new(),
            };
            if missing.is_empty() {
                break;
            }
            if let Some(failure) = &st.failure {
                return Err(self.aborted(op, failure));
            }
            let missing_ranks: Vec<usize> = missing.iter().map(|&i| self.ranks[i]).collect();
            if let Some(&gone) = missing_ranks.iter().find(|&&r| st.exited[r]) {
                let reason = format!(
                    "rank {gone} finished without joining {op} (called by rank {} at {site})",
                    self.me()
                );
                drop(st);
                self.shared.fail(self.me(), reason.clone());
                return Err(self.error(op, reason));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                let err = BackendError::Timeout {
                    op,
                    group: self.group(),
                    waiting: missing_ranks,
                    seconds: self.shared.config.timeout.as_secs_f64(),
                    site: site.to_string(),
                };
                self.shared.fail(self.me(), err.to_string());
                return Err(err);
            }
            st = self
                .shared
                .wake
                .wait_timeout(st, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        let mut received = Vec::with_capacity(n);
        let mut done = false;
        if let Some(slot) = st.slots.get_mut(&key) {
            for post in slot.posts.iter_mut().flatten() {
                let payload = post.outgoing.get_mut(self.index).and_then(Option::take);
                received.push((post.sig.clone(), payload));
            }
            slot.readers += 1;
            done = slot.readers == n;
        }
        if done {
            st.slots.remove(&key);
        }
        drop(st);
        // Every member checks the same signatures, so all report the same disagreement.
        let first = &received[0].0;
        for (i, (other, _)) in received.iter().enumerate().skip(1) {
            if other.op != first.op {
                return Err(self.error(
                    op,
                    format!(
                        "collective order mismatch: rank {} called {}, rank {} called {}",
                        self.ranks[0],
                        describe(first),
                        self.ranks[i],
                        describe(other)
                    ),
                ));
            }
            if other.dtype != first.dtype {
                return Err(self.error(
                    op,
                    format!(
                        "dtype mismatch: rank {} passed {:?} ({}), rank {} passed {:?} ({})",
                        self.ranks[0],
                        first.dtype,
                        first.site,
                        self.ranks[i],
                        other.dtype,
                        other.site
                    ),
                ));
            }
        }
        Ok(received)
    }

    pub(super) fn sig(&self, op: &'static str, data: &HostBuffer, site: CallSite) -> Signature {
        Signature {
            op,
            dtype: data.dtype(),
            shape: data.shape().to_vec(),
            splits: Vec::new(),
            recv_splits: Vec::new(),
            param: String::new(),
            site,
        }
    }

    /// Error unless every member's signature satisfies `same` relative to member 0.
    pub(super) fn agree(
        &self,
        op: &'static str,
        sigs: &[(Signature, Option<Payload>)],
        what: &str,
        same: impl Fn(&Signature, &Signature) -> bool,
        show: impl Fn(&Signature) -> String,
    ) -> Result<()> {
        let first = &sigs[0].0;
        for (i, (other, _)) in sigs.iter().enumerate().skip(1) {
            if !same(first, other) {
                return Err(self.error(
                    op,
                    format!(
                        "{what} mismatch: rank {} passed {} ({}), rank {} passed {} ({})",
                        self.ranks[0],
                        show(first),
                        first.site,
                        self.ranks[i],
                        show(other),
                        other.site
                    ),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn check_splits(
        &self,
        op: &'static str,
        data: &HostBuffer,
        splits: &[usize],
        what: &str,
        site: CallSite,
    ) -> Result<()> {
        let n = self.ranks.len();
        if splits.len() != n {
            return Err(self.error(
                op,
                format!(
                    "{what} has {} entries for {n} members (at {site})",
                    splits.len()
                ),
            ));
        }
        let (rows, _) = data.rows_and_row_bytes();
        let sum: usize = splits.iter().sum();
        if sum != rows || data.shape().is_empty() {
            return Err(self.error(
                op,
                format!(
                    "{what} {splits:?} sum to {sum} but the tensor has {rows} rows (at {site})"
                ),
            ));
        }
        Ok(())
    }
}
