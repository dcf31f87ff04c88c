//! Owner files and the removal of temporary directories left by dead saves.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use moe_backend::parallel::ParallelLayout;

use super::stale::process_start_time;
use super::*;
use crate::dist::testing::{
    TINY_LAYERS, TinyModel, synthetic_bytes, tiny_moe_tensors, tiny_rule, tiny_stage,
};
use crate::dist::{DistCheckpoint, SaveMeta, ShardingPlan, TensorMeta, save_offline};
use crate::test_util::TempDir;

/// A temporary save directory `name` in `root` holding one data file and, when given, `owner`.
fn fake_tmp(root: &Path, name: &str, owner: Option<&TempDirOwner>) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("shard-00000-model-00001-of-00001.safetensors"),
        b"partial",
    )
    .unwrap();
    if let Some(owner) = owner {
        owner.write(&dir).unwrap();
    }
    dir
}

/// Sets the modification time of `dir` and everything directly inside it `ago` in the past.
fn age(dir: &Path, ago: Duration) {
    let t = SystemTime::now() - ago;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(t)
            .unwrap();
    }
    std::fs::File::open(dir).unwrap().set_modified(t).unwrap();
}

/// An owner record of a process that has exited (and been reaped) on this host.
fn dead_owner() -> TempDirOwner {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    // Read while the child is still there (running or a zombie until waited for).
    let start_time = process_start_time(pid);
    child.wait().unwrap();
    TempDirOwner {
        pid,
        start_time,
        ..TempDirOwner::current()
    }
}

fn state_of(statuses: &[TempDirStatus], dir: &Path) -> TempDirState {
    statuses
        .iter()
        .find(|s| s.path == dir)
        .unwrap_or_else(|| panic!("{} not listed in {statuses:?}", dir.display()))
        .state
}

fn save_tiny(root: &Path, step: u64) -> PathBuf {
    let metas: Vec<TensorMeta> = tiny_moe_tensors();
    let bytes: Vec<Vec<u8>> = metas.iter().map(synthetic_bytes).collect();
    let views: Vec<(TensorMeta, &[u8])> = metas
        .iter()
        .cloned()
        .zip(bytes.iter().map(Vec::as_slice))
        .collect();
    let layout = ParallelLayout::parse(2, "tp=2").unwrap();
    let plan = ShardingPlan::new(&layout, Some(TINY_LAYERS), tiny_rule, tiny_stage).unwrap();
    save_offline(root, SaveMeta::new(step, &layout), &plan, &views).unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn the_owner_file_marks_a_save_in_progress_and_is_gone_after_the_commit() {
    let dir = TempDir::new("stale-owner");
    let start = begin_save_with(dir.path(), 4, &StalePolicy::default()).unwrap();
    let owner = TempDirOwner::read(&start.tmp).unwrap().unwrap();
    assert_eq!(owner.pid, std::process::id());
    if Path::new("/proc/self/stat").exists() {
        assert_eq!(owner.start_time, process_start_time(std::process::id()));
        assert!(owner.start_time.is_some());
    }
    let listed = temp_dirs(dir.path()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].path, start.tmp);
    assert_eq!(listed[0].owner.as_ref(), Some(&owner));
    abort_save(&start.tmp);
    // A committed checkpoint holds no owner file and validates.
    let saved = save_tiny(dir.path(), 5);
    assert!(!names(&saved).contains(&OWNER_FILE.to_owned()));
    DistCheckpoint::open::<TinyModel>(dir.path())
        .unwrap()
        .validate::<TinyModel>()
        .unwrap();
    assert!(DistCheckpoint::temp_dirs(dir.path()).unwrap().is_empty());
    // A root that does not exist has no temporary directories.
    assert!(temp_dirs(&dir.join("nothing")).unwrap().is_empty());
}

#[test]
fn a_dead_owners_temp_dir_is_removed_by_the_next_save_and_a_live_ones_kept() {
    let dir = TempDir::new("stale-dead");
    let root = dir.path();
    save_tiny(root, 1);
    let dead = fake_tmp(root, ".tmp-iter_0000002-dead", Some(&dead_owner()));
    let live = fake_tmp(
        root,
        ".tmp-iter_0000002-live",
        Some(&TempDirOwner::current()),
    );
    let listed = DistCheckpoint::temp_dirs(root).unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    if Path::new("/proc/self/stat").exists() {
        assert_eq!(state_of(&listed, &dead), TempDirState::Stale, "{listed:?}");
        assert!(listed[0].reason.contains("is gone"), "{listed:?}");
    }
    assert_eq!(state_of(&listed, &live), TempDirState::Live, "{listed:?}");
    // The next save removes the dead one, keeps the live one and commits.
    let saved = save_tiny(root, 3);
    assert_eq!(saved, root.join("iter_0000003"));
    if Path::new("/proc/self/stat").exists() {
        assert!(!dead.exists());
    }
    assert!(live.join(OWNER_FILE).is_file());
    let ckpt = DistCheckpoint::open::<TinyModel>(root).unwrap();
    assert_eq!(ckpt.index().step, 3);
    ckpt.validate::<TinyModel>().unwrap();
    // The cleanup report names what was removed and kept.
    let again = fake_tmp(root, ".tmp-iter_0000004-dead", Some(&dead_owner()));
    let start = begin_save_with(root, 4, &StalePolicy::default()).unwrap();
    if Path::new("/proc/self/stat").exists() {
        let removed: Vec<&Path> = start
            .cleanup
            .removed
            .iter()
            .map(|s| s.path.as_path())
            .collect();
        assert_eq!(removed, [again.as_path()]);
        assert!(
            start.cleanup.failed.is_empty(),
            "{:?}",
            start.cleanup.failed
        );
        let kept: Vec<&Path> = start
            .cleanup
            .kept
            .iter()
            .map(|s| s.path.as_path())
            .collect();
        assert_eq!(kept, [live.as_path()]);
    }
    abort_save(&start.tmp);
}

#[test]
fn owners_that_cannot_be_checked_and_missing_owner_files_age_out() {
    let dir = TempDir::new("stale-age");
    let root = dir.path();
    let young = fake_tmp(root, ".tmp-iter_0000001-young", None);
    let old = fake_tmp(root, ".tmp-iter_0000001-old", None);
    age(&old, NO_OWNER_GRACE + Duration::from_secs(600));
    let garbage = fake_tmp(root, ".tmp-iter_0000001-garbage", None);
    std::fs::write(garbage.join(OWNER_FILE), b"{not json").unwrap();
    let elsewhere = TempDirOwner {
        hostname: format!("not-{}", TempDirOwner::current().hostname),
        ..TempDirOwner::current()
    };
    let foreign = fake_tmp(root, ".tmp-iter_0000001-foreign", Some(&elsewhere));
    let foreign_old = fake_tmp(root, ".tmp-iter_0000001-foreign-old", Some(&elsewhere));
    age(&foreign_old, FOREIGN_OWNER_GRACE + Duration::from_secs(600));
    // Not a temporary save directory: never touched.
    let other = root.join(".tmp-something-else");
    std::fs::create_dir(&other).unwrap();
    age(&other, FOREIGN_OWNER_GRACE * 2);

    let listed = temp_dirs(root).unwrap();
    assert_eq!(listed.len(), 5, "{listed:?}");
    assert_eq!(state_of(&listed, &young), TempDirState::Pending);
    assert_eq!(state_of(&listed, &old), TempDirState::Stale);
    assert_eq!(state_of(&listed, &garbage), TempDirState::Pending);
    assert_eq!(state_of(&listed, &foreign), TempDirState::Pending);
    assert_eq!(state_of(&listed, &foreign_old), TempDirState::Stale);
    let old_status = listed.iter().find(|s| s.path == old).unwrap();
    assert!(old_status.owner.is_none());
    assert!(old_status.idle > NO_OWNER_GRACE, "{old_status:?}");
    assert!(
        old_status.reason.contains("no owner file"),
        "{old_status:?}"
    );

    // The grace periods are configurable.
    let strict = StalePolicy {
        no_owner_grace: Duration::ZERO,
        foreign_owner_grace: Duration::from_secs(60 * 60 * 24 * 365 * 10),
    };
    std::thread::sleep(Duration::from_millis(20));
    let listed = temp_dirs_with(root, &strict).unwrap();
    assert_eq!(state_of(&listed, &young), TempDirState::Stale);
    assert_eq!(state_of(&listed, &foreign_old), TempDirState::Pending);

    // The next save removes exactly the stale ones under the default policy.
    save_tiny(root, 2);
    assert!(young.exists() && garbage.exists() && foreign.exists() && other.exists());
    assert!(!old.exists() && !foreign_old.exists());
    DistCheckpoint::open::<TinyModel>(root)
        .unwrap()
        .validate::<TinyModel>()
        .unwrap();
}

#[test]
fn a_reused_pid_does_not_keep_a_temp_dir_alive() {
    if !Path::new("/proc/self/stat").exists() {
        return;
    }
    let dir = TempDir::new("stale-reuse");
    let me = TempDirOwner::current();
    let reused = TempDirOwner {
        start_time: me.start_time.map(|t| t + 1),
        ..me.clone()
    };
    let tmp = fake_tmp(dir.path(), ".tmp-iter_0000001-reused", Some(&reused));
    let listed = temp_dirs(dir.path()).unwrap();
    assert_eq!(state_of(&listed, &tmp), TempDirState::Stale, "{listed:?}");
    assert!(listed[0].reason.contains("another process"), "{listed:?}");
    // A host that rebooted since killed every owner.
    let rebooted = TempDirOwner {
        boot_id: Some("not-this-boot".to_owned()),
        ..me
    };
    rebooted.write(&tmp).unwrap();
    let listed = temp_dirs(dir.path()).unwrap();
    let expected = if TempDirOwner::current().boot_id.is_some() {
        TempDirState::Stale
    } else {
        TempDirState::Live
    };
    assert_eq!(state_of(&listed, &tmp), expected, "{listed:?}");
}
