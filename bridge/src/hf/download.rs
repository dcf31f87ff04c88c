//! Downloading a model into the hub cache with `hf-hub` (the `hub` feature).
//!
//! Fetched, as `transformers.from_pretrained` would for safetensors weights: `config.json`,
//! the shard index (else the single `model.safetensors`) and every shard it lists, plus the
//! optional `generation_config.json` and tokenizer files when the repository has them. Files
//! land in the standard cache layout (`blobs/`, `snapshots/<commit>/`, `refs/<revision>`), so
//! Python tools see them too; `HF_ENDPOINT` (mirrors) and `HF_TOKEN` (gated models) are
//! honoured, and `hf-hub` keeps a partial download resumable.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

use super::resolve::HubModelId;
use super::{CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, SINGLE_FILE, parse_index};
use crate::BridgeError;

/// Optional files, fetched when present (a 404 is not an error).
const OPTIONAL_FILES: [&str; 4] = [
    GENERATION_CONFIG_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// Downloads `id` into `cache` and returns its snapshot directory (`HF_ENDPOINT`, `HF_TOKEN`
/// from the environment; a progress bar per file).
pub(crate) fn download(id: &HubModelId, cache: &Path) -> Result<PathBuf, BridgeError> {
    let env = |key: &str| std::env::var(key).ok().filter(|v| !v.is_empty());
    download_from(id, cache, env("HF_ENDPOINT"), env("HF_TOKEN"), true)
}

/// [`download`] from `endpoint` (default `https://huggingface.co`) with `token`.
fn download_from(
    id: &HubModelId,
    cache: &Path,
    endpoint: Option<String>,
    token: Option<String>,
    progress: bool,
) -> Result<PathBuf, BridgeError> {
    let fail = |file: &str, reason: String| BridgeError::Download {
        id: id.to_string(),
        file: file.to_owned(),
        reason,
    };
    let mut builder =
        ApiBuilder::from_cache(Cache::new(cache.to_path_buf())).with_progress(progress);
    if let Some(endpoint) = endpoint {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_owned());
    }
    if token.is_some() {
        builder = builder.with_token(token);
    }
    let api = builder
        .build()
        .map_err(|e| fail("(client)", e.to_string()))?;
    let repo = api.repo(Repo::with_revision(
        id.repo_id.clone(),
        RepoType::Model,
        id.revision.clone(),
    ));
    tracing::info!(model = %id, cache = %cache.display(), "downloading from the hub");
    let config = get(&repo, CONFIG_FILE).map_err(|e| fail(CONFIG_FILE, e))?;
    let Some(snapshot) = config.parent().map(Path::to_path_buf) else {
        return Err(fail(
            CONFIG_FILE,
            "downloaded to a path without a parent".into(),
        ));
    };
    match try_get(&repo, INDEX_FILE).map_err(|e| fail(INDEX_FILE, e))? {
        Some(index) => {
            let text =
                std::fs::read_to_string(&index).map_err(|e| fail(INDEX_FILE, e.to_string()))?;
            let shards: BTreeSet<String> = parse_index(&text, &index)?.into_values().collect();
            for shard in &shards {
                get(&repo, shard).map_err(|e| fail(shard, e))?;
            }
        }
        None => {
            get(&repo, SINGLE_FILE).map_err(|e| fail(SINGLE_FILE, e))?;
        }
    }
    for file in OPTIONAL_FILES {
        try_get(&repo, file).map_err(|e| fail(file, e))?;
    }
    Ok(snapshot)
}

/// Fetches `file` (from the cache when already there).
fn get(repo: &ApiRepo, file: &str) -> Result<PathBuf, String> {
    try_get(repo, file)?.ok_or_else(|| "not in the repository (HTTP 404)".to_owned())
}

/// Fetches `file`; `None` when the repository has no such file.
fn try_get(repo: &ApiRepo, file: &str) -> Result<Option<PathBuf>, String> {
    match repo.get(file) {
        Ok(path) => Ok(Some(path)),
        Err(ApiError::RequestError(e)) if matches!(*e, ureq::Error::Status(404, _)) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::hf::resolve_in;
    use crate::test_util::TempDir;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    /// A minimal hub: `GET /{repo}/resolve/{rev}/{file}` with `Range` answered as the hub
    /// does (206, `Content-Range`, `ETag`, `X-Repo-Commit`), 404 for unknown files. Returns
    /// the endpoint and the log of requested paths.
    fn fake_hub(files: HashMap<String, Vec<u8>>) -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let log = Arc::new(Mutex::new(Vec::new()));
        let seen = log.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let path = line.split(' ').nth(1).unwrap_or("").to_owned();
                let mut range = None;
                loop {
                    let mut h = String::new();
                    reader.read_line(&mut h).unwrap();
                    if h.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
                        let (a, b) = v.trim().split_once('-').unwrap();
                        range = Some((a.parse::<usize>().unwrap(), b.parse::<usize>().ok()));
                    }
                }
                seen.lock().unwrap().push(path.clone());
                let file = path.rsplit('/').next().unwrap_or("");
                let response = match files.get(file) {
                    None => {
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            .to_vec()
                    }
                    Some(data) => {
                        let (a, b) = range.unwrap_or((0, None));
                        let b = b.unwrap_or(data.len() - 1).min(data.len() - 1);
                        let body = &data[a.min(data.len())..=b];
                        let mut r = format!(
                            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\n\
                             Content-Range: bytes {a}-{b}/{}\r\nETag: \"etag-{file}\"\r\n\
                             X-Repo-Commit: {COMMIT}\r\nConnection: close\r\n\r\n",
                            body.len(),
                            data.len()
                        )
                        .into_bytes();
                        r.extend_from_slice(body);
                        r
                    }
                };
                let _ = stream.write_all(&response);
            }
        });
        (endpoint, log)
    }

    fn model_files(shards: &[&str]) -> HashMap<String, Vec<u8>> {
        let weight_map: Vec<String> = shards
            .iter()
            .enumerate()
            .map(|(i, s)| format!("\"w{i}\": \"{s}\""))
            .collect();
        let mut files = HashMap::from([
            (
                "config.json".to_owned(),
                b"{\"model_type\": \"qwen3\"}".to_vec(),
            ),
            (
                INDEX_FILE.to_owned(),
                format!("{{\"weight_map\": {{{}}}}}", weight_map.join(", ")).into_bytes(),
            ),
            ("tokenizer.json".to_owned(), b"{}".to_vec()),
        ]);
        for (i, s) in shards.iter().enumerate() {
            files.insert((*s).to_owned(), vec![i as u8 + 1; 1000 + i]);
        }
        files
    }

    #[test]
    fn downloads_config_index_shards_and_optional_files_into_the_cache_layout() {
        let tmp = TempDir::new("hub-download");
        let cache = tmp.join("hub");
        let shards = [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ];
        let files = model_files(&shards);
        let (endpoint, log) = fake_hub(files.clone());
        let id = HubModelId::parse("org/tiny").unwrap();
        let snapshot = download_from(&id, &cache, Some(endpoint), None, false).unwrap();
        assert_eq!(
            snapshot,
            cache.join("models--org--tiny/snapshots").join(COMMIT)
        );
        for name in [
            "config.json",
            INDEX_FILE,
            shards[0],
            shards[1],
            "tokenizer.json",
        ] {
            assert_eq!(
                std::fs::read(snapshot.join(name)).unwrap(),
                files[name],
                "{name}"
            );
        }
        assert!(!snapshot.join(GENERATION_CONFIG_FILE).exists());
        let refs = std::fs::read_to_string(cache.join("models--org--tiny/refs/main")).unwrap();
        assert_eq!(refs, COMMIT);
        // Requests went to `{repo}/resolve/{revision}/{file}`.
        assert!(
            log.lock()
                .unwrap()
                .contains(&format!("/org/tiny/resolve/main/{}", shards[1]))
        );
        // The offline lookup now finds it, as huggingface_hub's cache would.
        assert_eq!(resolve_in("org/tiny", Some(cache)).unwrap(), snapshot);
    }

    #[test]
    fn a_shard_missing_on_the_hub_is_an_error_naming_it() {
        let tmp = TempDir::new("hub-missing");
        let mut files = model_files(&["a.safetensors", "b.safetensors"]);
        files.remove("b.safetensors");
        let (endpoint, _) = fake_hub(files);
        let id = HubModelId::parse("org/tiny@v2").unwrap();
        let err = download_from(&id, &tmp.join("hub"), Some(endpoint), None, false).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, BridgeError::Download { .. }), "{msg}");
        assert!(
            msg.contains("b.safetensors") && msg.contains("org/tiny@v2"),
            "{msg}"
        );
    }

    #[test]
    fn a_single_file_model_without_index() {
        let tmp = TempDir::new("hub-single");
        let files = HashMap::from([
            ("config.json".to_owned(), b"{}".to_vec()),
            (SINGLE_FILE.to_owned(), vec![7u8; 64]),
        ]);
        let (endpoint, _) = fake_hub(files);
        let id = HubModelId::parse("solo").unwrap();
        let snap = download_from(&id, &tmp.join("hub"), Some(endpoint), None, false).unwrap();
        assert_eq!(
            std::fs::read(snap.join(SINGLE_FILE)).unwrap(),
            vec![7u8; 64]
        );
        // Unreachable hub: an error naming the file, no panic.
        let err = download_from(
            &HubModelId::parse("org/other").unwrap(),
            &tmp.join("hub"),
            Some("http://127.0.0.1:9".to_owned()),
            None,
            false,
        )
        .unwrap_err();
        assert!(err.to_string().contains("config.json"), "{err}");
    }
}
