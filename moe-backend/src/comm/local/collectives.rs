//! The collectives of [`LocalComm`]: split, exchange through the rendezvous, check the
//! members' arguments against each other, and assemble the result. They work on
//! [`HostBuffer`]s, so the host path (`TensorData`) and the device path (Flex storage) are
//! one code path; blocks travel as ranges of the sender's buffer, copied once, into the
//! receiver's result.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::tensor::DType;

use super::rendezvous::LocalComm;
use super::{Mail, Payload};
use crate::comm::buffer::{HostBuffer, HostCollectives};
use crate::comm::data::reduce_blocks;
use crate::comm::{CallSite, PointToPoint, RecvSpec, ReduceOp, Traffic};
use crate::error::{BackendError, Result};

/// One payload per member: the blocks of `splits` rows of `buf`, shared, not copied.
fn payloads(buf: HostBuffer, splits: &[usize]) -> Vec<Option<Payload>> {
    let ranges = buf.row_ranges(splits);
    let buf = Arc::new(buf);
    ranges
        .into_iter()
        .map(|range| {
            Some(Payload {
                buf: Arc::clone(&buf),
                range,
            })
        })
        .collect()
}

impl HostCollectives for LocalComm {
    fn member(&self) -> usize {
        self.index
    }

    fn members(&self) -> &[usize] {
        &self.ranks
    }

    fn host_all_reduce(
        &self,
        data: HostBuffer,
        op: ReduceOp,
        site: CallSite,
    ) -> Result<HostBuffer> {
        const OP: &str = "all_reduce";
        let mut sig = self.sig(OP, &data, site);
        sig.param = format!("{op:?}");
        let shared = Arc::new(data);
        let outgoing = vec![Some(Payload::whole(&shared)); self.ranks.len()];
        let got = self.exchange(sig, outgoing)?;
        self.agree(
            OP,
            &got,
            "shape",
            |a, b| a.shape == b.shape,
            |s| format!("{:?}", s.shape),
        )?;
        self.agree(
            OP,
            &got,
            "reduce op",
            |a, b| a.param == b.param,
            |s| s.param.clone(),
        )?;
        let parts: Vec<&[u8]> = got
            .iter()
            .filter_map(|(_, p)| p.as_ref().map(Payload::bytes))
            .collect();
        let bytes = reduce_blocks(OP, &self.group(), &parts, shared.dtype(), op)?;
        Ok(HostBuffer::from_bytes(
            bytes,
            shared.shape().to_vec(),
            shared.dtype(),
        ))
    }

    fn host_all_gather_v(
        &self,
        data: HostBuffer,
        site: CallSite,
    ) -> Result<(HostBuffer, Vec<usize>)> {
        const OP: &str = "all_gather";
        if data.shape().is_empty() {
            return Err(self.error(OP, format!("a 0-d tensor has no dim 0 (at {site})")));
        }
        let sig = self.sig(OP, &data, site);
        let shared = Arc::new(data);
        let got = self.exchange(sig, vec![Some(Payload::whole(&shared)); self.ranks.len()])?;
        self.agree(
            OP,
            &got,
            "trailing shape",
            |a, b| a.shape.len() == b.shape.len() && a.shape[1..] == b.shape[1..],
            |s| format!("{:?}", s.shape),
        )?;
        let sizes: Vec<usize> = got.iter().map(|(s, _)| s.shape[0]).collect();
        let blocks: Vec<&[u8]> = got
            .iter()
            .filter_map(|(_, p)| p.as_ref().map(Payload::bytes))
            .collect();
        let out = HostBuffer::concat(
            blocks,
            sizes.iter().sum(),
            shared.trailing(),
            shared.dtype(),
        );
        Ok((out, sizes))
    }

    fn host_reduce_scatter_v(
        &self,
        data: HostBuffer,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<HostBuffer> {
        const OP: &str = "reduce_scatter";
        self.check_splits(OP, &data, splits, "splits", site)?;
        let mut sig = self.sig(OP, &data, site);
        sig.splits = splits.to_vec();
        sig.param = format!("{op:?}");
        let (shape, dtype) = (data.shape().to_vec(), data.dtype());
        let outgoing = payloads(data, splits);
        let got = self.exchange(sig, outgoing)?;
        self.agree(
            OP,
            &got,
            "shape",
            |a, b| a.shape == b.shape,
            |s| format!("{:?}", s.shape),
        )?;
        self.agree(
            OP,
            &got,
            "splits",
            |a, b| a.splits == b.splits,
            |s| format!("{:?}", s.splits),
        )?;
        self.agree(
            OP,
            &got,
            "reduce op",
            |a, b| a.param == b.param,
            |s| s.param.clone(),
        )?;
        let parts: Vec<&[u8]> = got
            .iter()
            .filter_map(|(_, p)| p.as_ref().map(Payload::bytes))
            .collect();
        let bytes = reduce_blocks(OP, &self.group(), &parts, dtype, op)?;
        let mut shape = shape;
        shape[0] = splits[self.index];
        Ok(HostBuffer::from_bytes(bytes, shape, dtype))
    }

    fn host_all_to_all_v(
        &self,
        data: HostBuffer,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<HostBuffer> {
        const OP: &str = "all_to_all_v";
        self.check_splits(OP, &data, send_splits, "send_splits", site)?;
        if recv_splits.len() != self.ranks.len() {
            return Err(self.error(
                OP,
                format!(
                    "recv_splits has {} entries for {} members (at {site})",
                    recv_splits.len(),
                    self.ranks.len()
                ),
            ));
        }
        let mut sig = self.sig(OP, &data, site);
        sig.splits = send_splits.to_vec();
        sig.recv_splits = recv_splits.to_vec();
        let (trailing, dtype) = (data.trailing().to_vec(), data.dtype());
        let outgoing = payloads(data, send_splits);
        let got = self.exchange(sig, outgoing)?;
        self.agree(
            OP,
            &got,
            "trailing shape",
            |a, b| a.shape.len() == b.shape.len() && a.shape[1..] == b.shape[1..],
            |s| format!("{:?}", s.shape),
        )?;
        // Every member checks the whole split matrix: recv[j][i] == send[i][j].
        for (i, (si, _)) in got.iter().enumerate() {
            for (j, (sj, _)) in got.iter().enumerate() {
                if sj.recv_splits[i] != si.splits[j] {
                    return Err(self.error(
                        OP,
                        format!(
                            "split mismatch: rank {} sends {} rows to rank {} (send_splits {:?} at {}), \
                             but rank {} expects {} (recv_splits {:?} at {})",
                            self.ranks[i],
                            si.splits[j],
                            self.ranks[j],
                            si.splits,
                            si.site,
                            self.ranks[j],
                            sj.recv_splits[i],
                            sj.recv_splits,
                            sj.site
                        ),
                    ));
                }
            }
        }
        let blocks: Vec<&[u8]> = got
            .iter()
            .filter_map(|(_, p)| p.as_ref().map(Payload::bytes))
            .collect();
        Ok(HostBuffer::concat(
            blocks,
            recv_splits.iter().sum(),
            &trailing,
            dtype,
        ))
    }

    fn host_broadcast(&self, data: HostBuffer, root: usize, site: CallSite) -> Result<HostBuffer> {
        const OP: &str = "broadcast";
        if root >= self.ranks.len() {
            return Err(self.error(
                OP,
                format!(
                    "root {root} out of range for {} members (at {site})",
                    self.ranks.len()
                ),
            ));
        }
        let mut sig = self.sig(OP, &data, site);
        sig.param = root.to_string();
        let outgoing = if self.index == root {
            vec![Some(Payload::whole(&Arc::new(data))); self.ranks.len()]
        } else {
            vec![None; self.ranks.len()]
        };
        let got = self.exchange(sig, outgoing)?;
        self.agree(
            OP,
            &got,
            "shape",
            |a, b| a.shape == b.shape,
            |s| format!("{:?}", s.shape),
        )?;
        self.agree(
            OP,
            &got,
            "root",
            |a, b| a.param == b.param,
            |s| s.param.clone(),
        )?;
        got.into_iter()
            .nth(root)
            .and_then(|(_, p)| p)
            .map(|p| Arc::try_unwrap(p.buf).unwrap_or_else(|shared| shared.duplicate()))
            .ok_or_else(|| self.error(OP, format!("no data from root {root} (at {site})")))
    }

    fn host_send(&self, data: HostBuffer, dst: usize, site: CallSite) -> Result<()> {
        self.batch(vec![(data, dst)], &[], "send", site).map(|_| ())
    }

    fn host_recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        site: CallSite,
    ) -> Result<HostBuffer> {
        let spec = RecvSpec {
            shape: shape.to_vec(),
            dtype,
            src,
        };
        let mut got = self.batch(Vec::new(), &[spec], "recv", site)?;
        got.pop()
            .ok_or_else(|| self.error("recv", format!("nothing received (at {site})")))
    }

    fn host_send_recv(
        &self,
        sends: Vec<(HostBuffer, usize)>,
        recvs: &[RecvSpec],
        site: CallSite,
    ) -> Result<Vec<HostBuffer>> {
        self.batch(sends, recvs, "send_recv", site)
    }

    fn host_traffic(&self) -> Traffic {
        Traffic {
            calls: self.calls.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
        }
    }

    fn host_barrier(&self, site: CallSite) -> Result<()> {
        let empty = HostBuffer::from_bytes(Vec::new(), vec![0], DType::F32);
        let sig = self.sig("barrier", &empty, site);
        self.exchange(sig, vec![None; self.ranks.len()]).map(|_| ())
    }
}

/// A point-to-point channel: `(group, from, to)`.
type Channel = (Arc<str>, usize, usize);

impl LocalComm {
    /// Point-to-point sends and receives issued together: every send is posted (in order, to
    /// its channel's queue), then the receives are filled as their messages arrive (in order
    /// per source), and — with [`PointToPoint::Rendezvous`] — the call returns only once every
    /// send of the batch has been taken by its receiver (NCCL's group semantics). Waits end
    /// with the world's failure, a peer that exited, or the timeout.
    fn batch(
        &self,
        sends: Vec<(HostBuffer, usize)>,
        recvs: &[RecvSpec],
        op: &'static str,
        site: CallSite,
    ) -> Result<Vec<HostBuffer>> {
        let me = self.me();
        let mut to = Vec::with_capacity(sends.len());
        for (_, dst) in &sends {
            let Some(&rank) = self.ranks.get(*dst) else {
                return Err(self.error(op, format!("destination {dst} out of range (at {site})")));
            };
            to.push(rank);
        }
        let mut from = Vec::with_capacity(recvs.len());
        for r in recvs {
            let Some(&rank) = self.ranks.get(r.src) else {
                return Err(self.error(op, format!("source {} out of range (at {site})", r.src)));
            };
            from.push(rank);
        }
        let rendezvous = self.shared.config.p2p == PointToPoint::Rendezvous;
        let deadline = Instant::now() + self.shared.config.timeout;
        let mut st = self.shared.lock();
        if let Some(failure) = &st.failure {
            return Err(self.aborted(op, failure));
        }
        // Post every send; remember the index each must see taken.
        let mut waits: Vec<(Channel, u64)> = Vec::with_capacity(sends.len());
        for ((data, _), &rank) in sends.into_iter().zip(&to) {
            if rank != me {
                self.count(data.bytes().len());
            } else {
                self.calls.fetch_add(1, Ordering::Relaxed);
            }
            let key = (Arc::clone(&self.key), me, rank);
            let sig = self.sig("send", &data, site);
            st.mail
                .entry(key.clone())
                .or_default()
                .push_back(Mail { sig, data });
            let posted = st.posted.entry(key.clone()).or_default();
            *posted += 1;
            waits.push((key, *posted));
        }
        self.shared.wake.notify_all();
        let mut out: Vec<Option<HostBuffer>> = (0..recvs.len()).map(|_| None).collect();
        loop {
            if let Some(failure) = &st.failure {
                return Err(self.aborted(op, failure));
            }
            // Fill the receives whose message is there, in order per source.
            let mut blocked_sources = Vec::new();
            let mut progress = false;
            for (k, spec) in recvs.iter().enumerate() {
                if out[k].is_some() || blocked_sources.contains(&from[k]) {
                    continue;
                }
                let key = (Arc::clone(&self.key), from[k], me);
                let Some(mail) = st.mail.get_mut(&key).and_then(VecDeque::pop_front) else {
                    blocked_sources.push(from[k]);
                    continue;
                };
                *st.taken.entry(key).or_default() += 1;
                progress = true;
                if mail.sig.shape != spec.shape || mail.sig.dtype != spec.dtype {
                    let detail = format!(
                        "rank {} sent {:?} {:?} (at {}), rank {me} expected {:?} {:?} (at {site})",
                        from[k],
                        mail.sig.dtype,
                        mail.sig.shape,
                        mail.sig.site,
                        spec.dtype,
                        spec.shape
                    );
                    drop(st);
                    self.shared.wake.notify_all();
                    return Err(self.error(op, detail));
                }
                out[k] = Some(mail.data);
            }
            if progress {
                self.shared.wake.notify_all();
            }
            let unsent: Vec<usize> = if rendezvous {
                waits
                    .iter()
                    .filter(|(key, n)| st.taken.get(key).copied().unwrap_or(0) < *n)
                    .map(|(key, _)| key.2)
                    .collect()
            } else {
                Vec::new()
            };
            let unfilled: Vec<usize> = (0..recvs.len())
                .filter(|&k| out[k].is_none())
                .map(|k| from[k])
                .collect();
            if unsent.is_empty() && unfilled.is_empty() {
                break;
            }
            let mut waiting: Vec<usize> = unsent.iter().chain(&unfilled).copied().collect();
            waiting.sort_unstable();
            waiting.dedup();
            if let Some(&gone) = waiting.iter().find(|&&r| st.exited[r]) {
                let what = if unfilled.contains(&gone) {
                    "sending to"
                } else {
                    "receiving from"
                };
                let reason =
                    format!("rank {gone} finished without {what} rank {me} ({op} at {site})");
                drop(st);
                self.shared.fail(me, reason.clone());
                return Err(self.error(op, reason));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                let err = BackendError::Timeout {
                    op,
                    group: self.group(),
                    waiting,
                    seconds: self.shared.config.timeout.as_secs_f64(),
                    site: site.to_string(),
                };
                self.shared.fail(me, err.to_string());
                return Err(err);
            }
            st = self
                .shared
                .wake
                .wait_timeout(st, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        Ok(out.into_iter().flatten().collect())
    }
}
