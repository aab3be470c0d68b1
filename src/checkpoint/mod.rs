//! A K3 checkpoint on disk: shard index and extra shard directories, typed tensor views,
//! and the routed-expert table.

pub mod expert_table;
pub mod file_stamp;
pub mod inspect;
pub mod model_tensors;
pub mod schema;
pub mod shards;
pub mod tensor;
pub mod tensor_prefix;

pub use expert_table::{ExpertLocation, ExpertTable};
pub use inspect::{inspect, InspectReport};
pub use model_tensors::ModelTensors;
pub use schema::{TensorClass, TensorKind, TensorSpec};
pub use tensor::{Dtype, TensorView};
pub use tensor_prefix::TensorPrefix;

use crate::config::{Config, MXFP4_GROUP};
use crate::quant::Mxfp4View;
use crate::routed_expert::ExpertWeights;
use anyhow::{anyhow, bail, Context, Result};
use shards::{Entry, Shard};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Name of the model config inside a snapshot.
pub const CONFIG_FILE: &str = "config.json";

/// An opened snapshot: validated config, memory-mapped shards, every text tensor located.
pub struct Checkpoint {
    /// The validated model config.
    pub config: Config,
    /// The snapshot directory (config and index come from here only).
    pub dir: PathBuf,
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
    experts: ExpertTable,
}

impl Checkpoint {
    /// Opens a snapshot; shards missing from `dir` are looked for in `extra_dirs`, in order.
    pub fn open(dir: &Path, extra_dirs: &[PathBuf]) -> Result<Checkpoint> {
        shards::check_dir(dir, "snapshot directory")?;
        for d in extra_dirs {
            shards::check_dir(d, "extra shard directory (K3_DIRS / --dirs)")?;
        }
        let config = Config::from_file(&dir.join(CONFIG_FILE))?;
        let set = shards::open_shards(dir, extra_dirs)?;
        let experts = ExpertTable::build(&config, &set.entries);
        Ok(Checkpoint {
            config,
            dir: dir.to_path_buf(),
            shards: set.shards,
            entries: set.entries,
            experts,
        })
    }

    /// A stored tensor by name (with or without the `language_model.` prefix), as stored.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let canon = name
            .strip_prefix(schema::LANGUAGE_MODEL_PREFIX)
            .unwrap_or(name);
        let (key, e) = self.entries.get_key_value(canon).ok_or_else(|| {
            anyhow!(
                "tensor `{canon}` is not in the checkpoint at {} (incomplete download, or not a K3 snapshot?)",
                self.dir.display()
            )
        })?;
        let shard = &self.shards[e.shard];
        Ok(TensorView {
            name: key,
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &shard.map[e.range.start as usize..e.range.end as usize],
            file: &shard.path,
        })
    }

    /// A stored tensor checked against its schema entry: dtype and (documented
    /// alternative) shape.
    pub fn tensor_spec(&self, spec: &TensorSpec) -> Result<TensorView<'_>> {
        let t = self.tensor(&spec.name)?;
        if !schema::dtype_accepted(spec, t.dtype) || !schema::shape_accepted(spec, t.shape) {
            bail!(
                "{}: tensor `{}`: expected {} {:?}, found {} {:?}",
                t.file.display(),
                spec.name,
                spec.dtype,
                spec.shape,
                t.dtype,
                t.shape
            );
        }
        Ok(t)
    }

    /// Whether a tensor (canonical or prefixed name) is present.
    pub fn contains(&self, name: &str) -> bool {
        let canon = name
            .strip_prefix(schema::LANGUAGE_MODEL_PREFIX)
            .unwrap_or(name);
        self.entries.contains_key(canon)
    }

    /// Canonical names of every text tensor present, in no particular order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The routed-expert table.
    pub fn experts(&self) -> &ExpertTable {
        &self.experts
    }

    /// The native MXFP4 bytes of one routed expert, borrowed from the mapped shard.
    pub fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>> {
        let loc = self.experts.get(layer, expert).ok_or_else(|| {
            let why = self
                .experts
                .problem(layer, expert)
                .unwrap_or("its tensors are missing");
            anyhow!(
                "expert {expert} of layer {layer} is unusable in {}: {why}",
                self.dir.display()
            )
        })?;
        let map = &self.shards[loc.shard].map;
        let bytes = |k: usize| &map[loc.parts[k].start as usize..loc.parts[k].end as usize];
        let (i, d) = (
            self.config.moe_intermediate_size,
            self.config.routed_expert_hidden_size,
        );
        // The table only admits experts whose parts match the schema shapes, so these
        // views have consistent lengths by construction.
        let view = |rows: usize, cols: usize, k: usize| Mxfp4View {
            rows,
            cols,
            packed: bytes(k),
            scales: bytes(k + 1),
        };
        debug_assert_eq!(bytes(1).len(), i * d / MXFP4_GROUP);
        Ok(ExpertWeights {
            w1: view(i, d, 0),
            w2: view(d, i, 2),
            w3: view(i, d, 4),
        })
    }

    /// Row `r` of a 2-D float tensor (the embedding table), read with a positional read
    /// rather than through the mapping, so a shard replaced under a running engine gives an
    /// error naming file and offset instead of a SIGBUS.
    pub fn read_row_f32(&self, name: &str, r: usize) -> Result<Vec<f32>> {
        let canon = name
            .strip_prefix(schema::LANGUAGE_MODEL_PREFIX)
            .unwrap_or(name);
        let e = self.entries.get(canon).ok_or_else(|| {
            anyhow!(
                "tensor `{canon}` is not in the checkpoint at {}",
                self.dir.display()
            )
        })?;
        let [rows, cols] = e.shape[..] else {
            bail!(
                "tensor `{canon}`: expected 2 dimensions, found {:?}",
                e.shape
            );
        };
        if r >= rows {
            bail!("tensor `{canon}`: row {r} is out of range ({rows} rows)");
        }
        let path = &self.shards[e.shard].path;
        let row_bytes = cols * e.dtype.size();
        let offset = e.range.start + (r * row_bytes) as u64;
        let mut buf = vec![0u8; row_bytes];
        let f =
            crate::platform::input_file::open(path, crate::platform::input_file::FileKind::Shard)?;
        crate::platform::positional_read::read_exact_at(&f.file, &mut buf, offset).with_context(
            || {
                format!(
                    "reading row {r} of `{canon}` ({row_bytes} bytes at offset {offset}) from {} \
                     (was the shard truncated or replaced?)",
                    path.display()
                )
            },
        )?;
        let view = TensorView {
            name: canon,
            dtype: e.dtype,
            shape: &e.shape[1..],
            bytes: &buf,
            file: path,
        };
        view.to_f32()
    }

    /// Drops the mapped shards' pages from this process's resident set (after the dense
    /// weights were copied out), so the RAM clamp measures what the engine really keeps.
    pub fn release_mapped_pages(&self) {
        for s in &self.shards {
            crate::platform::map_advice::release_pages(&s.map);
        }
    }

    /// Path of shard `shard` (as numbered by [`ExpertLocation::shard`]; panics beyond
    /// [`Checkpoint::shard_count`], which only a caller bug can reach).
    pub fn shard_path(&self, shard: usize) -> &Path {
        &self.shards[shard].path
    }

    /// Size and modification time of shard `shard` when it was opened (numbered as
    /// [`Checkpoint::shard_path`]).
    pub fn shard_stamp(&self, shard: usize) -> file_stamp::FileStamp {
        self.shards[shard].stamp
    }

    /// Number of mapped shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }
}
