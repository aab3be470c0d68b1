//! A streaming safetensors writer: the header is written from the tensor list up front,
//! then the tensor bytes are appended in whatever chunks the caller produces, so no
//! tensor or shard is ever held whole in memory.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::atomic_file::AtomicFile;

/// Capacity of the write buffer; larger writes bypass it.
const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// One tensor as the header describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HeaderEntry {
    /// Full tensor name.
    pub name: String,
    /// safetensors dtype string (`BF16`, `F32`, `U8`).
    pub dtype: &'static str,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Size of the tensor's data in bytes.
    pub bytes: u64,
}

/// The complete header block of a shard: the little-endian u64 length, then the JSON
/// padded with spaces to a multiple of 8 bytes so the data starts aligned. Tensors are
/// laid out back to back in the order given.
pub(crate) fn header_bytes(entries: &[HeaderEntry]) -> Result<Vec<u8>> {
    let mut json = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0u64;
    for e in entries {
        let name = serde_json::to_string(&e.name)
            .with_context(|| format!("encoding tensor name {:?}", e.name))?;
        let shape = serde_json::to_string(&e.shape)
            .with_context(|| format!("encoding the shape of {}", e.name))?;
        let end = offset + e.bytes;
        json.push_str(&format!(
            r#",{name}:{{"dtype":"{}","shape":{shape},"data_offsets":[{offset},{end}]}}"#,
            e.dtype
        ));
        offset = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    Ok(out)
}

/// A shard being written: header done, data appended by [`ShardWriter::write`]. It lives
/// under a temporary name ([`AtomicFile`]) until [`ShardWriter::finish`], so a failed write
/// (a full disk) leaves no shard under the real name.
pub(crate) struct ShardWriter {
    file: AtomicFile,
    expected: u64,
    written: u64,
}

impl ShardWriter {
    /// Starts the shard `path` (written under a temporary name until [`ShardWriter::finish`])
    /// with the header for `entries`.
    pub(crate) fn create(path: &Path, entries: &[HeaderEntry]) -> Result<ShardWriter> {
        let header = header_bytes(entries)?;
        let mut file = AtomicFile::with_buffer(path, WRITE_BUFFER_BYTES)
            .with_context(|| format!("creating shard {}", path.display()))?;
        file.write_all(&header)
            .with_context(|| format!("writing the header of shard {}", path.display()))?;
        Ok(ShardWriter {
            file,
            expected: entries.iter().map(|e| e.bytes).sum(),
            written: 0,
        })
    }

    /// Appends tensor data; refuses to write past the sizes the header announced.
    pub(crate) fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let after = self.written + bytes.len() as u64;
        if after > self.expected {
            bail!(
                "shard {}: data overruns the header ({after} > {} bytes)",
                self.file.path().display(),
                self.expected
            );
        }
        self.file.write_all(bytes)?;
        self.written = after;
        Ok(())
    }

    /// Syncs the shard and renames it into place after checking every announced byte was
    /// written; returns the data size.
    pub(crate) fn finish(self) -> Result<u64> {
        if self.written != self.expected {
            bail!(
                "shard {}: wrote {} data bytes, header announced {}",
                self.file.path().display(),
                self.written,
                self.expected
            );
        }
        self.file.commit()?;
        Ok(self.written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    #[test]
    fn streamed_shard_parses_with_the_safetensors_crate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        let entries = vec![
            HeaderEntry {
                name: "a\"quoted\".weight".into(),
                dtype: "BF16",
                shape: vec![3, 5],
                bytes: 30,
            },
            HeaderEntry {
                name: "b".into(),
                dtype: "U8",
                shape: vec![7],
                bytes: 7,
            },
        ];
        let mut w = ShardWriter::create(&path, &entries).unwrap();
        let data: Vec<u8> = (0..37u8).collect();
        w.write(&data[..10]).unwrap();
        w.write(&data[10..]).unwrap();
        assert!(w.write(&[0]).is_err());
        assert_eq!(w.finish().unwrap(), 37);

        let bytes = std::fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!((8 + header_len) % 8, 0);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let a = st.tensor("a\"quoted\".weight").unwrap();
        assert_eq!(a.shape(), &[3, 5]);
        assert_eq!(a.dtype(), safetensors::Dtype::BF16);
        assert_eq!(a.data(), &data[..30]);
        assert_eq!(st.tensor("b").unwrap().data(), &data[30..]);
    }

    #[test]
    fn short_shard_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let entries = vec![HeaderEntry {
            name: "x".into(),
            dtype: "U8",
            shape: vec![4],
            bytes: 4,
        }];
        let mut w = ShardWriter::create(&dir.path().join("x.safetensors"), &entries).unwrap();
        w.write(&[1, 2]).unwrap();
        assert!(w.finish().is_err());
    }
}
