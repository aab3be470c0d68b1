//! Element types of stored tensors and typed, borrowed views over their bytes.

use anyhow::{anyhow, bail, Context, Result};
use std::fmt;
use std::path::Path;

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bfloat16.
    Bf16,
    /// IEEE half (read only; K3 stores none).
    F16,
    /// IEEE single.
    F32,
    /// Raw bytes (MXFP4 nibbles and E8M0 scales).
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            Dtype::U8 => 1,
        }
    }

    /// The safetensors header spelling.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::U8 => "U8",
        }
    }

    /// Parses the safetensors header spelling; `None` for dtypes the engine never reads.
    pub fn from_safetensors_name(name: &str) -> Option<Dtype> {
        match name {
            "BF16" => Some(Dtype::Bf16),
            "F16" => Some(Dtype::F16),
            "F32" => Some(Dtype::F32),
            "U8" => Some(Dtype::U8),
            _ => None,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

/// A borrowed view of one stored tensor: its bytes in the mapped shard, as stored.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// Canonical name.
    pub name: &'a str,
    /// Stored element type.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: &'a [usize],
    /// The raw little-endian bytes.
    pub bytes: &'a [u8],
    /// The shard file that holds it.
    pub file: &'a Path,
}

impl TensorView<'_> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Every element widened to f32.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        decode_f32(self.dtype, self.bytes).with_context(|| self.context())
    }

    /// Every element as bf16 bits (f32 and f16 are rounded to nearest even).
    pub fn to_bf16_bits(&self) -> Result<Vec<u16>> {
        let pairs = || self.bytes.chunks_exact(2);
        match self.dtype {
            Dtype::Bf16 => Ok(pairs().map(|b| u16::from_le_bytes([b[0], b[1]])).collect()),
            Dtype::F16 | Dtype::F32 => Ok(self
                .to_f32()?
                .into_iter()
                .map(|x| half::bf16::from_f32(x).to_bits())
                .collect()),
            Dtype::U8 => Err(not_float(self.dtype)).with_context(|| self.context()),
        }
    }

    /// Row `r` of a tensor seen as `[shape[0], numel / shape[0]]`, widened to f32.
    pub fn row_f32(&self, r: usize) -> Result<Vec<f32>> {
        let rows = self.shape.first().copied().unwrap_or(1);
        if r >= rows {
            bail!("{}: row {r} is out of range ({rows} rows)", self.context());
        }
        let row_bytes = self.bytes.len() / rows.max(1);
        let start = r * row_bytes;
        decode_f32(self.dtype, &self.bytes[start..start + row_bytes])
            .with_context(|| self.context())
    }

    fn context(&self) -> String {
        format!(
            "{}: tensor `{}` ({} {:?})",
            self.file.display(),
            self.name,
            self.dtype,
            self.shape
        )
    }
}

/// A stored tensor's place and form, without its bytes: what a check of dtype and shape
/// needs.
#[derive(Clone, Copy, Debug)]
pub struct TensorInfo<'a> {
    /// Canonical name.
    pub name: &'a str,
    /// Stored element type.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: &'a [usize],
    /// Bytes it takes in the shard.
    pub byte_len: usize,
    /// The shard file that holds it.
    pub file: &'a Path,
}

/// A stored tensor read from its shard: its bytes as stored, owned.
#[derive(Clone, Debug)]
pub struct Tensor {
    /// Canonical name.
    pub name: String,
    /// Stored element type.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// The raw little-endian bytes.
    pub bytes: Vec<u8>,
    /// The shard file that held it.
    pub file: std::path::PathBuf,
}

impl Tensor {
    /// A view of it, for the conversions.
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            name: &self.name,
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.bytes,
            file: &self.file,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.view().numel()
    }

    /// Every element widened to f32.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        self.view().to_f32()
    }

    /// Every element as bf16 bits (f32 and f16 are rounded to nearest even).
    pub fn to_bf16_bits(&self) -> Result<Vec<u16>> {
        self.view().to_bf16_bits()
    }
}

fn not_float(dtype: Dtype) -> anyhow::Error {
    anyhow!("is {dtype} (raw MXFP4 bytes), not a float tensor")
}

fn decode_f32(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::U8 => return Err(not_float(dtype)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(dtype: Dtype, shape: &'a [usize], bytes: &'a [u8]) -> TensorView<'a> {
        TensorView {
            name: "t",
            dtype,
            shape,
            bytes,
            file: Path::new("f.safetensors"),
        }
    }

    #[test]
    fn decodes_each_float_dtype() {
        let vals = [1.5f32, -2.0, 0.25, 3.0];
        let f32_bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf_bytes: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let f16_bytes: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let shape = [2, 2];
        for (d, b) in [
            (Dtype::F32, &f32_bytes),
            (Dtype::Bf16, &bf_bytes),
            (Dtype::F16, &f16_bytes),
        ] {
            let v = view(d, &shape, b);
            assert_eq!(v.to_f32().unwrap(), vals);
            assert_eq!(v.row_f32(1).unwrap(), vals[2..]);
            assert_eq!(
                v.to_bf16_bits().unwrap()[1],
                half::bf16::from_f32(-2.0).to_bits()
            );
            assert!(v
                .row_f32(2)
                .unwrap_err()
                .to_string()
                .contains("row 2 is out of range"));
        }
        let e = view(Dtype::U8, &shape, &f32_bytes[..4])
            .to_f32()
            .unwrap_err();
        assert!(
            format!("{e:#}").contains("f.safetensors: tensor `t`"),
            "{e:#}"
        );
    }
}
