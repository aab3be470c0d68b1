//! A K3 checkpoint on disk: shard index and extra shard directories, typed tensor views,
//! and the routed-expert table.

pub(crate) mod expert_table;
pub(crate) mod file_stamp;
pub mod inspect;
pub(crate) mod model_tensors;
pub mod schema;
pub mod shards;
pub(crate) mod tensor;
pub(crate) mod tensor_prefix;
pub(crate) mod tensor_spec;

pub use expert_table::{ExpertLocation, ExpertTable};
pub use inspect::{inspect, InspectReport};
pub use model_tensors::ModelTensors;
pub use schema::{TensorClass, TensorKind, TensorSpec};
pub use tensor::{Dtype, Tensor, TensorInfo, TensorView};
pub use tensor_prefix::TensorPrefix;

use crate::config::{Config, MXFP4_GROUP};
use crate::quant::Mxfp4View;
use crate::routed_expert::ExpertWeights;
use anyhow::{anyhow, bail, Result};
use shards::{Entry, Shard};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Name of the model config inside a snapshot.
pub const CONFIG_FILE: &str = "config.json";

/// An opened snapshot: validated config, open shards, every text tensor located.
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
        Self::open_part(dir, extra_dirs, None)
    }

    /// [`Checkpoint::open`] opening only the shard files in `only` (all with `None`): a rank
    /// of an expert-parallel job needs only those holding its experts (and, on the head,
    /// the dense weights). Tensors in other files are absent from the result.
    pub fn open_part(
        dir: &Path,
        extra_dirs: &[PathBuf],
        only: Option<&std::collections::BTreeSet<String>>,
    ) -> Result<Checkpoint> {
        shards::check_dir(dir, "snapshot directory")?;
        for d in extra_dirs {
            shards::check_dir(d, "extra shard directory (K3_DIRS / --dirs)")?;
        }
        let config = Config::from_file(&dir.join(CONFIG_FILE))?;
        let set = shards::open_shards(dir, extra_dirs, only)?;
        let experts = ExpertTable::build(&config, &set.entries);
        Ok(Checkpoint {
            config,
            dir: dir.to_path_buf(),
            shards: set.shards,
            entries: set.entries,
            experts,
        })
    }

    /// The entry of a tensor named with or without the `language_model.` prefix.
    fn entry(&self, name: &str) -> Result<(&str, &Entry)> {
        let canon = name
            .strip_prefix(schema::LANGUAGE_MODEL_PREFIX)
            .unwrap_or(name);
        let (key, e) = self.entries.get_key_value(canon).ok_or_else(|| {
            anyhow!(
                "tensor `{canon}` is not in the checkpoint at {} (incomplete download, or not a K3 snapshot?)",
                self.dir.display()
            )
        })?;
        Ok((key.as_str(), e))
    }

    /// A stored tensor's dtype, shape and place by name (with or without the
    /// `language_model.` prefix), without reading it.
    pub fn tensor_info(&self, name: &str) -> Result<TensorInfo<'_>> {
        let (key, e) = self.entry(name)?;
        Ok(TensorInfo {
            name: key,
            dtype: e.dtype,
            shape: &e.shape,
            byte_len: (e.range.end - e.range.start) as usize,
            file: &self.shards[e.shard].path,
        })
    }

    /// A stored tensor by name (with or without the `language_model.` prefix), read from
    /// its shard as stored ([`shards::Shard::read`]: a shard that changed is an error).
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let (key, e) = self.entry(name)?;
        let shard = &self.shards[e.shard];
        let bytes = shard.read(e.range.clone(), &format!("tensor `{key}`"))?;
        Ok(Tensor {
            name: key.to_string(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            bytes,
            file: shard.path.clone(),
        })
    }

    /// A stored tensor's dtype and shape checked against its schema entry (or a documented
    /// alternative shape), without reading it.
    pub fn tensor_spec_info(&self, spec: &TensorSpec) -> Result<TensorInfo<'_>> {
        let t = self.tensor_info(&spec.name)?;
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

    /// A stored tensor checked against its schema entry ([`Self::tensor_spec_info`]), then
    /// read.
    pub fn tensor_spec(&self, spec: &TensorSpec) -> Result<Tensor> {
        self.tensor_spec_info(spec)?;
        self.tensor(&spec.name)
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

    /// The native MXFP4 bytes of one routed expert, read from its shard (the engine's
    /// expert path reads them through `experts::ExpertReader`; this is the plain read).
    pub fn expert(&self, layer: usize, expert: usize) -> Result<ExpertData> {
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
        let shard = &self.shards[loc.shard];
        let mut parts: [Vec<u8>; 6] = Default::default();
        for (k, p) in parts.iter_mut().enumerate() {
            *p = shard.read(
                loc.parts[k].clone(),
                &format!("part {k} of expert {expert} of layer {layer}"),
            )?;
        }
        // The table only admits experts whose parts match the schema shapes, so the views
        // of `ExpertData::weights` have consistent lengths by construction.
        Ok(ExpertData {
            inter: self.config.moe_intermediate_size,
            hidden: self.config.routed_expert_hidden_size,
            parts,
        })
    }

    /// Row `r` of a 2-D float tensor (the embedding table), read from the shard opened at
    /// load and checked against its stamp, so a shard rewritten, cut or replaced under a
    /// running engine gives an error naming file and offset instead of other answers.
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
        let shard = &self.shards[e.shard];
        let path = &shard.path;
        let row_bytes = cols * e.dtype.size();
        let offset = e.range.start + (r * row_bytes) as u64;
        let buf = shard.read(
            offset..offset + row_bytes as u64,
            &format!("row {r} of `{canon}`"),
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

    /// Path of shard `shard` (as numbered by [`ExpertLocation::shard`]; panics beyond
    /// [`Checkpoint::shard_count`], which only a caller bug can reach).
    pub fn shard_path(&self, shard: usize) -> &Path {
        &self.shards[shard].path
    }

    /// The identity of shard `shard` when it was opened (numbered as
    /// [`Checkpoint::shard_path`]).
    pub fn shard_stamp(&self, shard: usize) -> file_stamp::FileStamp {
        self.shards[shard].stamp
    }

    /// The hash of shard `shard`'s header and sampled blocks, taken when it was opened.
    pub fn shard_sampled(&self, shard: usize) -> u64 {
        self.shards[shard].sampled
    }

    /// Number of open shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The shards holding a tensor that is not a routed expert's (the dense weights), in
    /// file order: what the head of an expert-parallel job reads besides its experts.
    pub fn dense_shards(&self) -> Vec<usize> {
        let mut used = vec![false; self.shards.len()];
        for (name, e) in &self.entries {
            if schema::parse_expert_name(name).is_none() {
                if let Some(u) = used.get_mut(e.shard) {
                    *u = true;
                }
            }
        }
        (0..used.len()).filter(|&i| used[i]).collect()
    }
}

/// One routed expert's six stored parts, read from its shard.
#[derive(Clone, Debug)]
pub struct ExpertData {
    inter: usize,
    hidden: usize,
    parts: [Vec<u8>; 6],
}

impl ExpertData {
    /// The kernels' MXFP4 views of the parts.
    pub fn weights(&self) -> ExpertWeights<'_> {
        let (i, d) = (self.inter, self.hidden);
        let view = |rows: usize, cols: usize, k: usize| Mxfp4View {
            rows,
            cols,
            packed: &self.parts[k],
            scales: &self.parts[k + 1],
        };
        debug_assert_eq!(self.parts[1].len(), i * d / MXFP4_GROUP);
        ExpertWeights {
            w1: view(i, d, 0),
            w2: view(d, i, 2),
            w3: view(i, d, 4),
        }
    }
}
