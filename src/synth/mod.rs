//! `k3 synth`: writes a random-weight Kimi K3 checkpoint in exactly the published
//! on-disk format (config, index, BF16 dense shards, MXFP4 experts, a vision shard),
//! streamed in bounded chunks so even a real-size slice needs little memory.

mod layout;
mod presets;
pub use presets::{MAX_EXPERTS, MAX_LAYERS, MAX_ROUTED_EXPERTS};
mod random_weights;
mod safetensors_writer;
mod topics;
pub use topics::Routing;

use std::fs;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::checkpoint::model_tensors::ModelTensors;
use crate::config::Config;
use layout::{plan_shards, shard_file_name, PlannedTensor};
use presets::Dims;
use random_weights::{fill, StreamKey, BLOCK_ELEMS};
use safetensors_writer::{HeaderEntry, ShardWriter};
use topics::Topics;

/// Blocks generated per chunk: 4 Mi elements, at most 16 MiB of buffer.
const CHUNK_BLOCKS: usize = 64;
/// What the synth wrote (preset, layers, experts, seed), for whoever finds the directory.
const MARKER_FILE: &str = ".k3-synth.json";
/// The index file name of a sharded Hugging Face checkpoint.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// A synthetic checkpoint preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// A few hundred KB: unit tests and quick runs.
    Tiny,
    /// About 100 MB: enough experts and layers to exercise caching and scheduling.
    Small,
    /// The real K3 dimensions with few layers (tens of GB at the defaults).
    K3Slice,
}

impl Preset {
    /// The spelling on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::K3Slice => "k3-slice",
        }
    }
}

impl FromStr for Preset {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Preset> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            "k3-slice" => Ok(Preset::K3Slice),
            other => bail!("--preset {other:?}: expected one of tiny, small, k3-slice"),
        }
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to synthesize.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthOptions {
    /// Base dimensions.
    pub preset: Preset,
    /// Overrides the preset's layer count (`--layers`).
    pub layers: Option<usize>,
    /// Overrides the preset's routed expert count (`--experts`).
    pub experts: Option<usize>,
    /// Overrides the preset's experts per token (`--top-k`).
    pub top_k: Option<usize>,
    /// Random routing or topic locality (`--routing`).
    pub routing: Routing,
    /// Seed of every random value (`--seed`); same seed, same bytes.
    pub seed: u64,
    /// Show a progress bar in bytes on stderr.
    pub progress: bool,
}

/// What [`synthesize`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthSummary {
    /// Bytes of all shard files, headers included.
    pub bytes: u64,
    /// Number of shard files, the vision shard included.
    pub shards: usize,
    /// Number of tensors, vision ones included.
    pub tensors: usize,
}

/// The `config.json` that [`synthesize`] writes for `opts`.
pub fn preset_config(opts: &SynthOptions) -> Result<Value> {
    Ok(presets::root_config(&Dims::from_options(opts)?))
}

/// Writes the checkpoint for `opts` into `out` (created if missing); a non-empty `out` is
/// refused, so no file of the user's is ever touched.
pub fn synthesize(opts: &SynthOptions, out: &Path) -> Result<SynthSummary> {
    synthesize_as(opts, out, false)
}

/// [`synthesize`] into a directory that may hold files (`k3 synth --force`): the files this
/// run writes replace those of the same name; nothing else is deleted or changed.
pub fn synthesize_over(opts: &SynthOptions, out: &Path) -> Result<SynthSummary> {
    synthesize_as(opts, out, true)
}

/// Writes only the `config.json` of `opts` into `out` (`k3 synth --config-only`): enough
/// for `k3 inspect --plan`, whose plan needs no tensor data. A non-empty `out` is refused
/// unless `force`.
pub fn write_config_only(opts: &SynthOptions, out: &Path, force: bool) -> Result<PathBuf> {
    let config_text = pretty(&presets::root_config(&Dims::from_options(opts)?))?;
    Config::from_json_str(&config_text, "synthesized config.json")
        .context("the synthesized config does not parse (a preset bug)")?;
    prepare_dir(out, force)?;
    let path = out.join("config.json");
    write_file(&path, &config_text)?;
    Ok(path)
}

fn synthesize_as(opts: &SynthOptions, out: &Path, force: bool) -> Result<SynthSummary> {
    let dims = Dims::from_options(opts)?;
    let config = presets::root_config(&dims);
    let config_text = pretty(&config)?;
    let cfg = Config::from_json_str(&config_text, "synthesized config.json")
        .context("the synthesized config does not parse (a preset bug)")?;
    prepare_dir(out, force)?;
    if force {
        // The index and config are written last: removing the old ones first means a run
        // that fails part way (a full disk) never leaves an index over a mix of old and new
        // shards that loads as valid. Both are files this run replaces.
        for name in [INDEX_FILE, "config.json"] {
            let p = out.join(name);
            match fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(anyhow::Error::new(e).context(format!(
                        "removing the old {} before rewriting it",
                        p.display()
                    )))
                }
                _ => {}
            }
        }
    }
    let mut marker = json!({
        "preset": opts.preset.name(),
        "layers": dims.layers,
        "experts": dims.experts,
        "seed": opts.seed,
    });
    // Only what differs from the defaults is added, so a default run writes the marker it
    // always wrote.
    if let Some(map) = marker.as_object_mut() {
        if opts.top_k.is_some() {
            map.insert("top_k".into(), json!(dims.top_k));
        }
        if opts.routing != Routing::Random {
            map.insert("routing".into(), json!(opts.routing.name()));
        }
    }
    write_file(&out.join(MARKER_FILE), &pretty(&marker)?)?;

    let topics = (opts.routing == Routing::Local)
        .then(|| Topics::new(&dims, opts.seed, &ModelTensors::new(&cfg)));
    let shards = plan_shards(&cfg, opts.seed, dims.max_shard_bytes);
    let data_bytes: u64 = shards.iter().flatten().map(PlannedTensor::bytes).sum();
    let bar = progress_bar(opts.progress, data_bytes);
    let mut buffer = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let mut summary = SynthSummary {
        bytes: 0,
        shards: shards.len(),
        tensors: 0,
    };
    for (i, tensors) in shards.iter().enumerate() {
        let file_name = shard_file_name(i, shards.len());
        let path = out.join(&file_name);
        let entries: Vec<HeaderEntry> = tensors
            .iter()
            .map(|t| HeaderEntry {
                name: t.name.clone(),
                dtype: t.dtype.safetensors_name(),
                shape: t.shape.clone(),
                bytes: t.bytes(),
            })
            .collect();
        let mut writer = ShardWriter::create(&path, &entries)?;
        for t in tensors {
            write_tensor(
                &mut writer,
                t,
                opts.seed,
                topics.as_ref(),
                &mut buffer,
                &bar,
            )?;
            weight_map.insert(t.name.clone(), Value::String(file_name.clone()));
        }
        writer.finish()?;
        summary.bytes += fs::metadata(&path)
            .with_context(|| format!("reading the size of {}", path.display()))?
            .len();
        summary.tensors += tensors.len();
    }
    bar.finish_and_clear();

    let index = json!({
        "metadata": { "total_size": data_bytes },
        "weight_map": weight_map,
    });
    write_file(&out.join(INDEX_FILE), &pretty(&index)?)?;
    write_file(&out.join("config.json"), &config_text)?;
    write_file(
        &out.join("generation_config.json"),
        &pretty(&presets::generation_config(&dims))?,
    )?;
    // Every synthetic checkpoint carries a small real tokenizer, so text prompts and the
    // chat format work on it like on the release.
    let bos = cfg
        .bos_token_id
        .context("synthesized config has no bos_token_id")?;
    let eos = *cfg
        .eos_token_ids
        .first()
        .context("synthesized config has no eos_token_id")?;
    let pad = cfg
        .pad_token_id
        .context("synthesized config has no pad_token_id")?;
    crate::tokenizer::synthetic::write_synthetic_tokenizer(out, cfg.vocab_size, bos, eos, pad)?;
    Ok(summary)
}

/// Streams one tensor into the shard in chunks of whole blocks, with the topic parts of
/// `--routing local` added to the rows that carry them.
fn write_tensor(
    writer: &mut ShardWriter,
    t: &PlannedTensor,
    seed: u64,
    topics: Option<&Topics>,
    buffer: &mut Vec<u8>,
    bar: &ProgressBar,
) -> Result<()> {
    let key = StreamKey::new(seed, &t.name);
    let init = t.init;
    let elem = t.dtype.size();
    let numel: u64 = t.shape.iter().product::<usize>() as u64;
    let chunk_elems = (CHUNK_BLOCKS * BLOCK_ELEMS) as u64;
    let mut first = 0u64;
    while first < numel {
        let n = chunk_elems.min(numel - first) as usize;
        buffer.resize(n * elem, 0);
        fill(key, init, t.dtype, first, buffer);
        if let Some(topics) = topics {
            topics.add_to(&t.name, t.dtype, first, buffer);
        }
        writer
            .write(buffer)
            .with_context(|| format!("writing tensor {}", t.name))?;
        bar.inc(buffer.len() as u64);
        first += n as u64;
    }
    Ok(())
}

fn progress_bar(show: bool, total: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} synth [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Creates `out`, or accepts it when empty or a previous synth output (whose old shards
/// are removed, since the shard count may change).
fn prepare_dir(out: &Path, force: bool) -> Result<()> {
    if !out.exists() {
        return fs::create_dir_all(out)
            .with_context(|| format!("creating output directory {}", out.display()));
    }
    if !out.is_dir() {
        bail!(
            "{} exists and is not a directory; choose a new OUT_DIR",
            out.display()
        );
    }
    let mut entries = fs::read_dir(out).with_context(|| format!("listing {}", out.display()))?;
    if entries.next().is_some() && !force {
        bail!(
            "{} is not empty: choose an empty or new OUT_DIR, or pass --force to overwrite \
             the files synth writes there (nothing else is deleted)",
            out.display()
        );
    }
    Ok(())
}

/// `v` as pretty JSON with sorted keys ([`crate::canonical_json`]): the conformance
/// fixtures fingerprint these files.
fn pretty(v: &Value) -> Result<String> {
    let mut s = crate::canonical_json::to_string_pretty(v).context("encoding JSON")?;
    s.push('\n');
    Ok(s)
}

/// Writes `text` to `path` through a temporary name, so an interrupted run never leaves a
/// half-written file under the real name.
fn write_file(path: &Path, text: &str) -> Result<()> {
    crate::atomic_file::write_atomically(path, text.as_bytes())
}

/// The config of `preset` with `layers` layers (the preset's own count when `None`), as the
/// unit tests of the planners size it.
#[cfg(test)]
pub(crate) fn preset_config_for_tests(
    preset: Preset,
    layers: Option<usize>,
) -> crate::config::Config {
    let opts = SynthOptions {
        preset,
        layers,
        experts: None,
        top_k: None,
        routing: Routing::Random,
        seed: 0,
        progress: false,
    };
    let text = preset_config(&opts).unwrap().to_string();
    crate::config::Config::from_json_str(&text, "a synth preset").unwrap()
}
