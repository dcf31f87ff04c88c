//! Ownership of temporary save directories and the removal of those left behind by saves that
//! died before their commit (a process killed with `-9`, a crash, a lost node).
//!
//! Every save writes an owner file [`OWNER_FILE`] into its `.tmp-iter_*` directory as soon as
//! the directory exists: host name, process id, the process's start time (field 22 of
//! `/proc/<pid>/stat`), boot id, PID namespace and creation time ([`TempDirOwner`]). The commit
//! removes it again, so committed checkpoints look exactly as before.
//!
//! A later save into the same root (rank 0, before creating its own directory) classifies the
//! temporary directories it finds ([`temp_dirs_with`]) and removes the stale ones
//! ([`remove_stale_temp_dirs`]):
//!
//! - owner on this host (same host name and PID namespace): **stale** when the host was
//!   rebooted since (boot id differs), the process is gone (or a zombie), or its pid now
//!   belongs to a process with another start time (pid reuse); **live** otherwise, and a live
//!   directory is never removed;
//! - owner on another host, or whose liveness cannot be checked here (no `/proc`, another
//!   user's process hidden by `hidepid`): stale once idle longer than
//!   [`StalePolicy::foreign_owner_grace`] (default [`FOREIGN_OWNER_GRACE`], 24 h);
//! - no owner file (saves by older versions, a save killed between `mkdir` and writing the
//!   owner) or an unreadable one: stale once idle longer than [`StalePolicy::no_owner_grace`]
//!   (default [`NO_OWNER_GRACE`], 1 h).
//!
//! "Idle" is the time since the newest modification time of the directory and of the entries
//! directly inside it, so a directory some rank is still writing into never ages.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::BridgeError;

/// Name of the owner file inside a temporary save directory.
pub const OWNER_FILE: &str = ".owner";
/// Name prefix of the temporary directories saves create in a checkpoint root
/// (`.tmp-iter_{step:07}-{nonce}`).
pub const TEMP_DIR_PREFIX: &str = ".tmp-iter_";
/// Default idle time after which a temporary directory without (readable) owner file is stale.
pub const NO_OWNER_GRACE: Duration = Duration::from_secs(60 * 60);
/// Default idle time after which a temporary directory whose owner cannot be checked from this
/// host (another host, hidden process) is stale.
pub const FOREIGN_OWNER_GRACE: Duration = Duration::from_secs(24 * 60 * 60);

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BridgeError + '_ {
    move |source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Grace periods of the staleness rules (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StalePolicy {
    /// Idle time after which a directory without (readable) owner file is stale.
    pub no_owner_grace: Duration,
    /// Idle time after which a directory owned by a process this host cannot check is stale.
    pub foreign_owner_grace: Duration,
}

impl Default for StalePolicy {
    fn default() -> Self {
        Self {
            no_owner_grace: NO_OWNER_GRACE,
            foreign_owner_grace: FOREIGN_OWNER_GRACE,
        }
    }
}

/// The process that created a temporary save directory, as recorded in its [`OWNER_FILE`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TempDirOwner {
    /// Host name of the owner (`/proc/sys/kernel/hostname`, `/etc/hostname` or `$HOSTNAME`;
    /// empty when unknown).
    pub hostname: String,
    /// Process id of the owner.
    pub pid: u32,
    /// Start time of the owner process in clock ticks since boot (field 22 of
    /// `/proc/<pid>/stat`), to tell a reused pid from the owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<u64>,
    /// `/proc/sys/kernel/random/boot_id` of the owner's host (a reboot kills every owner).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// The owner's PID namespace (`readlink /proc/self/ns/pid`); pids of another namespace
    /// cannot be checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_namespace: Option<String>,
    /// When the directory was created, in seconds since the Unix epoch.
    #[serde(default)]
    pub created_unix: u64,
}

impl TempDirOwner {
    /// The calling process, now.
    pub fn current() -> Self {
        let pid = std::process::id();
        Self {
            hostname: hostname().unwrap_or_default(),
            pid,
            start_time: process_start_time(pid),
            boot_id: boot_id(),
            pid_namespace: pid_namespace(),
            created_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    /// Reads the owner file of `dir`: `Ok(None)` when there is none,
    /// [`BridgeError::InvalidJson`] when it is not an owner record.
    pub fn read(dir: &Path) -> Result<Option<Self>, BridgeError> {
        let path = dir.join(OWNER_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| BridgeError::InvalidJson {
                path,
                reason: e.to_string(),
            })
    }

    /// Writes this record as the owner file of `dir` atomically
    /// ([`moe_backend::fs::write_atomic`]), so readers never see half a record.
    pub fn write(&self, dir: &Path) -> Result<(), BridgeError> {
        let path = dir.join(OWNER_FILE);
        let text = serde_json::to_string(self).map_err(|e| BridgeError::InvalidJson {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(moe_backend::fs::write_atomic_bytes(
            &path,
            format!("{text}\n").as_bytes(),
        )?)
    }
}

/// What a temporary save directory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TempDirState {
    /// Its owner process is alive on this host: a save in progress. Never removed.
    Live,
    /// Its owner cannot be shown dead yet (no owner file, or an owner this host cannot check)
    /// and it has not been idle past the grace period: possibly a save in progress. Kept.
    Pending,
    /// Left by a save that died: the next save into the root removes it.
    Stale,
}

/// One temporary save directory of a checkpoint root and its classification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TempDirStatus {
    /// The directory.
    pub path: PathBuf,
    /// Its owner record, when it has a readable one.
    pub owner: Option<TempDirOwner>,
    /// Live, pending or stale.
    pub state: TempDirState,
    /// Why, in words (e.g. "owner process 1234 on node7 is gone").
    pub reason: String,
    /// Time since the newest modification of the directory or an entry in it.
    pub idle: Duration,
}

impl TempDirStatus {
    /// Whether the next save removes it.
    pub fn is_stale(&self) -> bool {
        self.state == TempDirState::Stale
    }
}

/// What [`remove_stale_temp_dirs`] did.
#[derive(Debug, Default)]
pub struct CleanupReport {
    /// The stale directories removed (callers log them).
    pub removed: Vec<TempDirStatus>,
    /// The live and pending directories left in place.
    pub kept: Vec<TempDirStatus>,
    /// Stale directories that could not be removed, and why.
    pub failed: Vec<BridgeError>,
}

/// The temporary save directories of `root` under the default [`StalePolicy`], sorted by path;
/// none when `root` does not exist.
pub fn temp_dirs(root: &Path) -> Result<Vec<TempDirStatus>, BridgeError> {
    temp_dirs_with(root, &StalePolicy::default())
}

/// The temporary save directories (`.tmp-iter_*`, not following symlinks) of `root`, classified
/// under `policy`, sorted by path; none when `root` does not exist.
pub fn temp_dirs_with(
    root: &Path,
    policy: &StalePolicy,
) -> Result<Vec<TempDirStatus>, BridgeError> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(root)(e)),
    };
    let here = Host::current();
    let now = SystemTime::now();
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(TEMP_DIR_PREFIX) {
            continue;
        }
        let path = entry.path();
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            // Removed since the listing (its save committed or another cleaner got it).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(&path)(e)),
        };
        if !meta.is_dir() {
            continue;
        }
        out.push(classify(path, &meta, &here, now, policy));
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Removes the stale temporary save directories of `root` (see the module docs); live and
/// pending ones are kept. Fails only when `root` cannot be listed; a directory that cannot be
/// removed is reported in [`CleanupReport::failed`].
pub fn remove_stale_temp_dirs(
    root: &Path,
    policy: &StalePolicy,
) -> Result<CleanupReport, BridgeError> {
    let mut report = CleanupReport::default();
    for status in temp_dirs_with(root, policy)? {
        if !status.is_stale() {
            report.kept.push(status);
            continue;
        }
        match std::fs::remove_dir_all(&status.path) {
            Ok(()) => report.removed.push(status),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => report.removed.push(status),
            Err(e) => report.failed.push(io(&status.path)(e)),
        }
    }
    Ok(report)
}

/// Classifies one temporary directory.
fn classify(
    path: PathBuf,
    meta: &std::fs::Metadata,
    here: &Host,
    now: SystemTime,
    policy: &StalePolicy,
) -> TempDirStatus {
    let idle = now
        .duration_since(last_activity(&path, meta))
        .unwrap_or(Duration::ZERO);
    let by_age = |grace: Duration, why: String| {
        if idle > grace {
            (
                TempDirState::Stale,
                format!("{why}, idle for {} (grace {})", human(idle), human(grace)),
            )
        } else {
            (
                TempDirState::Pending,
                format!(
                    "{why}, idle for {} of its grace {}",
                    human(idle),
                    human(grace)
                ),
            )
        }
    };
    let (owner, (state, reason)) = match TempDirOwner::read(&path) {
        Ok(None) => (None, by_age(policy.no_owner_grace, "no owner file".into())),
        Err(e) => (
            None,
            by_age(
                policy.no_owner_grace,
                format!("unreadable owner file ({e})"),
            ),
        ),
        Ok(Some(owner)) => {
            let verdict = match here.liveness(&owner, dir_uid(meta)) {
                Liveness::Alive(why) => (TempDirState::Live, why),
                Liveness::Dead(why) => (TempDirState::Stale, why),
                Liveness::Unknown(why) => by_age(policy.foreign_owner_grace, why),
            };
            (Some(owner), verdict)
        }
    };
    TempDirStatus {
        path,
        owner,
        state,
        reason,
        idle,
    }
}

/// The newest modification time of `dir` and of the entries directly inside it.
fn last_activity(dir: &Path, meta: &std::fs::Metadata) -> SystemTime {
    let mut newest = meta.modified().unwrap_or(UNIX_EPOCH);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if let Ok(t) = entry.metadata().and_then(|m| m.modified()) {
                newest = newest.max(t);
            }
        }
    }
    newest
}

/// `1h05m`, `3m20s`, `42s`.
fn human(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// Whether an owner process still runs, as far as this host can tell.
enum Liveness {
    Alive(String),
    Dead(String),
    Unknown(String),
}

/// This host's identity, read once per listing.
struct Host {
    hostname: Option<String>,
    boot_id: Option<String>,
    pid_namespace: Option<String>,
    /// Whether `/proc/<pid>/stat` can be consulted at all.
    procfs: bool,
    uid: Option<u32>,
}

impl Host {
    fn current() -> Self {
        Self {
            hostname: hostname(),
            boot_id: boot_id(),
            pid_namespace: pid_namespace(),
            procfs: Path::new("/proc/self/stat").is_file(),
            uid: current_uid(),
        }
    }

    /// The liveness of `owner`; `dir_uid` is the uid owning its directory.
    fn liveness(&self, owner: &TempDirOwner, dir_uid: Option<u32>) -> Liveness {
        let who = format!("owner process {} on {}", owner.pid, display_host(owner));
        let same_host = self
            .hostname
            .as_deref()
            .is_some_and(|h| !owner.hostname.is_empty() && h == owner.hostname);
        if !same_host {
            return Liveness::Unknown(format!("{who} (another host)"));
        }
        if let (Some(a), Some(b)) = (&self.pid_namespace, &owner.pid_namespace)
            && a != b
        {
            return Liveness::Unknown(format!("{who} (another PID namespace)"));
        }
        if let (Some(a), Some(b)) = (&self.boot_id, &owner.boot_id)
            && a != b
        {
            return Liveness::Dead(format!("{who} is gone (the host rebooted since)"));
        }
        if !self.procfs {
            return Liveness::Unknown(format!("{who} (no /proc to check it)"));
        }
        match read_stat(owner.pid) {
            None => {
                if dir_uid.is_some() && self.uid.is_some() && dir_uid != self.uid {
                    // Another user's processes may be hidden (`hidepid`).
                    Liveness::Unknown(format!("{who} (another user's process, not visible)"))
                } else {
                    Liveness::Dead(format!("{who} is gone"))
                }
            }
            Some(stat) if matches!(stat.state, 'Z' | 'X' | 'x') => {
                Liveness::Dead(format!("{who} is gone (exited)"))
            }
            Some(stat) => match (owner.start_time, stat.start_time) {
                (Some(a), Some(b)) if a != b => Liveness::Dead(format!(
                    "{who} is gone (pid {} now belongs to another process)",
                    owner.pid
                )),
                _ => Liveness::Alive(format!("{who} is alive")),
            },
        }
    }
}

fn display_host(owner: &TempDirOwner) -> &str {
    if owner.hostname.is_empty() {
        "an unknown host"
    } else {
        &owner.hostname
    }
}

/// The parts of `/proc/<pid>/stat` used here.
struct ProcStat {
    /// Field 3.
    state: char,
    /// Field 22.
    start_time: Option<u64>,
}

/// `/proc/<pid>/stat`, or `None` when there is no such process (or no `/proc`).
fn read_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2 is `(comm)`, which may hold spaces and parentheses: fields 3… follow the last `)`.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // `fields` now starts at field 4; field 22 is 18 further.
    let start_time = fields.nth(18).and_then(|f| f.parse().ok());
    Some(ProcStat { state, start_time })
}

/// Start time of process `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`).
pub(crate) fn process_start_time(pid: u32) -> Option<u64> {
    read_stat(pid)?.start_time
}

fn read_trimmed(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn hostname() -> Option<String> {
    read_trimmed("/proc/sys/kernel/hostname")
        .or_else(|| read_trimmed("/etc/hostname"))
        .or_else(|| {
            std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.trim().is_empty())
        })
}

fn boot_id() -> Option<String> {
    read_trimmed("/proc/sys/kernel/random/boot_id")
}

fn pid_namespace() -> Option<String> {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

#[cfg(unix)]
fn current_uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

#[cfg(not(unix))]
fn current_uid() -> Option<u32> {
    None
}

#[cfg(unix)]
fn dir_uid(meta: &std::fs::Metadata) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    Some(meta.uid())
}

#[cfg(not(unix))]
fn dir_uid(_: &std::fs::Metadata) -> Option<u32> {
    None
}
