//! Finding a model directory: a local path, or a snapshot in the HuggingFace hub cache.
//!
//! Downloading is not implemented (an opt-in `hub` feature may add it later); a model that is
//! neither a local directory nor in the cache is a [`BridgeError::ModelNotFound`].

use std::path::{Path, PathBuf};

use crate::BridgeError;

/// The hub cache directory: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (`None` when none of these can be formed).
pub fn hub_cache_dir() -> Option<PathBuf> {
    hub_cache_dir_from(|key| std::env::var_os(key).map(PathBuf::from))
}

/// [`hub_cache_dir`] with the environment supplied by `env` (for tests).
fn hub_cache_dir_from(env: impl Fn(&str) -> Option<PathBuf>) -> Option<PathBuf> {
    let non_empty = |key: &str| env(key).filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = non_empty("HF_HUB_CACHE") {
        return Some(dir);
    }
    if let Some(home) = non_empty("HF_HOME") {
        return Some(home.join("hub"));
    }
    non_empty("HOME").map(|home| home.join(".cache").join("huggingface").join("hub"))
}

/// Resolves `id_or_path` to a model directory.
///
/// An existing directory wins. Otherwise `id_or_path` is read as a hub id `org/name` (or
/// `name`) and looked up in the hub cache ([`hub_cache_dir`]) as
/// `models--{org}--{name}/snapshots/<hash>/`, where `<hash>` is the content of
/// `models--{org}--{name}/refs/main`.
pub fn resolve_model_dir(id_or_path: &str) -> Result<PathBuf, BridgeError> {
    resolve_in(id_or_path, hub_cache_dir())
}

/// [`resolve_model_dir`] against an explicit cache directory.
pub fn resolve_in(id_or_path: &str, cache: Option<PathBuf>) -> Result<PathBuf, BridgeError> {
    let direct = Path::new(id_or_path);
    if direct.is_dir() {
        return Ok(direct.to_path_buf());
    }
    let mut searched = vec![direct.to_path_buf()];
    if let (Some(cache), Some(repo)) = (cache, repo_folder_name(id_or_path)) {
        let repo_dir = cache.join(repo);
        let refs_main = repo_dir.join("refs").join("main");
        searched.push(refs_main.clone());
        if let Ok(hash) = std::fs::read_to_string(&refs_main) {
            let hash = hash.trim();
            if is_plain_component(hash) {
                let snapshot = repo_dir.join("snapshots").join(hash);
                if snapshot.is_dir() {
                    return Ok(snapshot);
                }
                searched.push(snapshot);
            }
        }
    }
    Err(BridgeError::ModelNotFound {
        id: id_or_path.to_owned(),
        searched,
    })
}

/// `models--org--name` for the hub id `org/name` (`None` if it is not a valid id).
fn repo_folder_name(id: &str) -> Option<String> {
    let parts: Vec<&str> = id.split('/').collect();
    if parts.is_empty() || parts.len() > 2 || !parts.iter().all(|p| is_plain_component(p)) {
        return None;
    }
    Some(format!("models--{}", parts.join("--")))
}

/// A non-empty path component that cannot escape its parent.
fn is_plain_component(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\', '\0'])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;

    #[test]
    fn cache_dir_precedence() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| PathBuf::from(v))
            }
        };
        let all = env(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h"), ("HOME", "/u")]);
        assert_eq!(hub_cache_dir_from(all), Some(PathBuf::from("/c")));
        let home = env(&[("HF_HOME", "/h"), ("HOME", "/u")]);
        assert_eq!(hub_cache_dir_from(home), Some(PathBuf::from("/h/hub")));
        let user = env(&[("HF_HUB_CACHE", ""), ("HOME", "/u")]);
        assert_eq!(
            hub_cache_dir_from(user),
            Some(PathBuf::from("/u/.cache/huggingface/hub"))
        );
        assert_eq!(hub_cache_dir_from(env(&[])), None);
    }

    #[test]
    fn resolves_local_dirs_and_cache_snapshots() {
        let tmp = TempDir::new("resolve");
        let local = tmp.join("local-model");
        std::fs::create_dir_all(&local).unwrap();
        let local_str = local.to_str().unwrap();
        assert_eq!(resolve_in(local_str, None).unwrap(), local);

        let cache = tmp.join("hub");
        let repo = cache.join("models--deepseek-ai--DeepSeek-V3");
        let snap = repo.join("snapshots").join("abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs").join("main"), "abc123\n").unwrap();
        let got = resolve_in("deepseek-ai/DeepSeek-V3", Some(cache.clone())).unwrap();
        assert_eq!(got, snap);

        let err = resolve_in("Qwen/Qwen3-30B-A3B", Some(cache.clone())).unwrap_err();
        assert!(matches!(err, BridgeError::ModelNotFound { .. }));
        assert!(err.to_string().contains("Qwen/Qwen3-30B-A3B"));
        // A ref pointing outside the snapshots folder is ignored.
        std::fs::write(repo.join("refs").join("main"), "../../x").unwrap();
        assert!(resolve_in("deepseek-ai/DeepSeek-V3", Some(cache)).is_err());
        assert!(repo_folder_name("a/b/c").is_none() && repo_folder_name("../x").is_none());
    }
}
