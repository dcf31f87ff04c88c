//! Finding a model directory: a local path, or a snapshot in the HuggingFace hub cache
//! (looked up with the `hf-hub` crate), downloaded into that cache behind the opt-in `hub`
//! feature.
//!
//! A hub reference is `org/name` or `org/name@revision`; the revision is a branch or tag (read
//! through `refs/<revision>` as `huggingface_hub` writes it) or a commit hash (its snapshot
//! folder directly). The cache directory follows `huggingface_hub`'s precedence:
//! `$HF_HUB_CACHE`, the legacy `$HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`, then
//! `~/.cache/huggingface/hub`. `hf_hub::Cache::from_env` only reads `HF_HOME`, so the directory
//! is chosen here and handed to `hf_hub::Cache::new`.

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use crate::BridgeError;
use crate::hf::CONFIG_FILE;

/// A model on the hub: `org/name[@revision]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubModelId {
    /// `org/name` (or `name`).
    pub repo_id: String,
    /// Branch, tag or commit hash; `main` when not given.
    pub revision: String,
}

impl HubModelId {
    /// Parses `org/name` or `org/name@revision`; `None` when `s` is not a valid hub id (each
    /// part a plain path component, at most one `/` in the repo id, no empty revision).
    pub fn parse(s: &str) -> Option<Self> {
        let (repo_id, revision) = match s.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (s, "main"),
        };
        let parts: Vec<&str> = repo_id.split('/').collect();
        let plain_repo = parts.len() <= 2 && parts.iter().all(|p| is_plain_component(p));
        // Branch names may hold `/` (`refs/pr/1`); every segment must stay inside the cache.
        let plain_rev = revision.split('/').all(is_plain_component);
        (plain_repo && plain_rev).then(|| Self {
            repo_id: repo_id.to_owned(),
            revision: revision.to_owned(),
        })
    }

    fn repo(&self) -> Repo {
        Repo::with_revision(self.repo_id.clone(), RepoType::Model, self.revision.clone())
    }

    /// Whether the revision is a full commit hash (40 hex digits).
    fn is_commit_hash(&self) -> bool {
        self.revision.len() == 40 && self.revision.bytes().all(|b| b.is_ascii_hexdigit())
    }
}

impl std::fmt::Display for HubModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.repo_id, self.revision)
    }
}

/// The hub cache directory: `$HF_HUB_CACHE`, else `$HUGGINGFACE_HUB_CACHE`, else
/// `$HF_HOME/hub`, else `~/.cache/huggingface/hub` (`None` when none of these can be formed).
pub fn hub_cache_dir() -> Option<PathBuf> {
    hub_cache_dir_from(|key| std::env::var_os(key).map(PathBuf::from))
}

/// [`hub_cache_dir`] with the environment supplied by `env` (for tests).
fn hub_cache_dir_from(env: impl Fn(&str) -> Option<PathBuf>) -> Option<PathBuf> {
    let non_empty = |key: &str| env(key).filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = non_empty("HF_HUB_CACHE").or_else(|| non_empty("HUGGINGFACE_HUB_CACHE")) {
        return Some(dir);
    }
    if let Some(home) = non_empty("HF_HOME") {
        return Some(home.join("hub"));
    }
    non_empty("HOME").map(|home| home.join(".cache").join("huggingface").join("hub"))
}

/// Resolves `id_or_path` to a model directory.
///
/// An existing directory wins. Otherwise `id_or_path` is read as a hub id
/// (`org/name[@revision]`, [`HubModelId`]) and looked up in the hub cache ([`hub_cache_dir`]).
/// With the `hub` feature, a model missing from the cache is downloaded into it (config,
/// index, every shard the index lists, generation config and tokenizer files) unless
/// `HF_HUB_OFFLINE` is set; `HF_ENDPOINT` and `HF_TOKEN` are honoured.
pub fn resolve_model_dir(id_or_path: &str) -> Result<PathBuf, BridgeError> {
    let cache = hub_cache_dir();
    match resolve_in(id_or_path, cache.clone()) {
        #[cfg(feature = "hub")]
        Err(BridgeError::ModelNotFound { .. }) if !offline() => {
            if let (Some(id), Some(cache)) = (HubModelId::parse(id_or_path), cache) {
                crate::hf::download::download(&id, &cache)
            } else {
                resolve_in(id_or_path, None)
            }
        }
        other => other,
    }
}

/// `HF_HUB_OFFLINE` set to a true value (`1`, `true`, `yes`, `on`), as `huggingface_hub`.
#[cfg(feature = "hub")]
fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// [`resolve_model_dir`] against an explicit cache directory, without downloading.
pub fn resolve_in(id_or_path: &str, cache: Option<PathBuf>) -> Result<PathBuf, BridgeError> {
    let direct = Path::new(id_or_path);
    if direct.is_dir() {
        return Ok(direct.to_path_buf());
    }
    let mut searched = vec![direct.to_path_buf()];
    if let (Some(cache), Some(id)) = (cache, HubModelId::parse(id_or_path)) {
        let repo = id.repo();
        let repo_dir = cache.join(repo.folder_name());
        let snapshots = repo_dir.join("snapshots");
        let config = Cache::new(cache.clone()).repo(repo).get(CONFIG_FILE);
        if let Some(snapshot) = config
            .as_deref()
            .and_then(Path::parent)
            .filter(|s| is_inside(s, &snapshots))
        {
            return Ok(snapshot.to_path_buf());
        }
        searched.push(repo_dir.join("refs").join(&id.revision));
        // `hf-hub` reads revisions through `refs/`; a commit hash names its snapshot directly.
        if id.is_commit_hash() {
            let snapshot = snapshots.join(&id.revision);
            if snapshot.join(CONFIG_FILE).is_file() {
                return Ok(snapshot);
            }
            searched.push(snapshot);
        }
    }
    Err(BridgeError::ModelNotFound {
        id: id_or_path.to_owned(),
        searched,
    })
}

/// Whether `dir` is an existing directory directly inside `parent` (a ref pointing elsewhere,
/// e.g. `../../x`, is ignored).
fn is_inside(dir: &Path, parent: &Path) -> bool {
    match (dir.canonicalize(), parent.canonicalize()) {
        (Ok(dir), Ok(parent)) => dir.parent() == Some(parent.as_path()),
        _ => false,
    }
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
        let all = env(&[
            ("HF_HUB_CACHE", "/c"),
            ("HUGGINGFACE_HUB_CACHE", "/l"),
            ("HF_HOME", "/h"),
            ("HOME", "/u"),
        ]);
        assert_eq!(hub_cache_dir_from(all), Some(PathBuf::from("/c")));
        let legacy = env(&[("HUGGINGFACE_HUB_CACHE", "/l"), ("HF_HOME", "/h")]);
        assert_eq!(hub_cache_dir_from(legacy), Some(PathBuf::from("/l")));
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
    fn parses_hub_ids() {
        let id = HubModelId::parse("deepseek-ai/DeepSeek-V3").unwrap();
        assert_eq!(
            (id.repo_id.as_str(), id.revision.as_str()),
            ("deepseek-ai/DeepSeek-V3", "main")
        );
        let id = HubModelId::parse("Qwen/Qwen3-0.6B@refs/pr/1").unwrap();
        assert_eq!(
            (id.repo_id.as_str(), id.revision.as_str()),
            ("Qwen/Qwen3-0.6B", "refs/pr/1")
        );
        assert_eq!(id.to_string(), "Qwen/Qwen3-0.6B@refs/pr/1");
        assert_eq!(HubModelId::parse("gpt2").unwrap().repo_id, "gpt2");
        for bad in [
            "a/b/c",
            "../x",
            "a/..",
            "a/b@",
            "a/b@../../x",
            "",
            "a//b",
            "a/b@x/../y",
        ] {
            assert!(HubModelId::parse(bad).is_none(), "{bad}");
        }
    }

    /// Lays out `models--{org}--{name}` as `huggingface_hub` writes it: `refs/<rev>` holding
    /// the commit hash (no newline), `snapshots/<hash>/config.json`.
    fn fake_snapshot(cache: &Path, repo: &str, refs: &[&str], hash: &str) -> PathBuf {
        let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
        let snap = repo_dir.join("snapshots").join(hash);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join(CONFIG_FILE), "{}").unwrap();
        for r in refs {
            let ref_path = repo_dir.join("refs").join(r);
            std::fs::create_dir_all(ref_path.parent().unwrap()).unwrap();
            std::fs::write(ref_path, hash).unwrap();
        }
        snap
    }

    #[test]
    fn resolves_local_dirs_and_cache_snapshots_by_revision() {
        let tmp = TempDir::new("resolve");
        let local = tmp.join("local-model");
        std::fs::create_dir_all(&local).unwrap();
        let local_str = local.to_str().unwrap();
        assert_eq!(resolve_in(local_str, None).unwrap(), local);

        let cache = tmp.join("hub");
        let main_hash = "0123456789abcdef0123456789abcdef01234567";
        let pr_hash = "89abcdef0123456789abcdef0123456789abcdef";
        let main = fake_snapshot(&cache, "deepseek-ai/DeepSeek-V3", &["main"], main_hash);
        let pr = fake_snapshot(
            &cache,
            "deepseek-ai/DeepSeek-V3",
            &["refs/pr/7", "v1"],
            pr_hash,
        );
        let resolve = |id: &str| resolve_in(id, Some(cache.clone()));
        assert_eq!(resolve("deepseek-ai/DeepSeek-V3").unwrap(), main);
        assert_eq!(resolve("deepseek-ai/DeepSeek-V3@main").unwrap(), main);
        assert_eq!(resolve("deepseek-ai/DeepSeek-V3@v1").unwrap(), pr);
        assert_eq!(resolve("deepseek-ai/DeepSeek-V3@refs/pr/7").unwrap(), pr);
        // A commit hash names its snapshot without a ref.
        assert_eq!(
            resolve(&format!("deepseek-ai/DeepSeek-V3@{pr_hash}")).unwrap(),
            pr
        );

        for missing in [
            "Qwen/Qwen3-30B-A3B",
            "deepseek-ai/DeepSeek-V3@v2",
            "deepseek-ai/DeepSeek-V3@ffffffffffffffffffffffffffffffffffffffff",
        ] {
            let err = resolve(missing).unwrap_err();
            assert!(
                matches!(err, BridgeError::ModelNotFound { .. }),
                "{missing}"
            );
            assert!(err.to_string().contains(missing), "{err}");
        }
        // A ref pointing outside the snapshots folder is ignored, even if a model is there.
        let escape = tmp.join("escape");
        std::fs::create_dir_all(&escape).unwrap();
        std::fs::write(escape.join(CONFIG_FILE), "{}").unwrap();
        let refs_main = cache.join("models--deepseek-ai--DeepSeek-V3/refs/main");
        std::fs::write(&refs_main, "../../../escape").unwrap();
        assert!(resolve("deepseek-ai/DeepSeek-V3").is_err());
    }
}
