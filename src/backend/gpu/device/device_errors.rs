//! wgpu reports a failed call (a validation error, the device out of memory) to an
//! uncaptured-error handler whose default panics. This keeps the first such error instead,
//! and the context's waiting points (readbacks, `finish`) return it as an error that says
//! what to do, so a run that overruns the GPU's memory ends with a message, not a panic.

use anyhow::{anyhow, Result};
use std::sync::{Arc, Mutex};

/// The first error the device reported outside an error scope.
#[derive(Clone, Default)]
pub(crate) struct DeviceErrors {
    first: Arc<Mutex<Option<(String, bool)>>>,
}

impl DeviceErrors {
    /// Installs the handler on `device`; errors from then on are kept, not panicked on.
    pub(crate) fn install(device: &wgpu::Device) -> Self {
        let me = Self::default();
        let first = me.first.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let oom = matches!(e, wgpu::Error::OutOfMemory { .. });
            let mut slot = first.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert((e.to_string(), oom));
        }));
        me
    }

    /// Keeps `msg` as an error of the engine's own (no out-of-memory), unless an earlier
    /// error is already kept.
    pub(crate) fn report(&self, msg: String) {
        let mut slot = self.first.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert((msg, false));
    }

    /// `Err` naming the first error the device reported, with what to do about it.
    pub(crate) fn check(&self, adapter: &str) -> Result<()> {
        let slot = self.first.lock().unwrap_or_else(|p| p.into_inner());
        match &*slot {
            None => Ok(()),
            Some((msg, oom)) => Err(anyhow!(
                "the GPU ({adapter}) reported an error: {msg}\n{}",
                hint(*oom, msg)
            )),
        }
    }
}

/// What a user can do about a device error.
pub(crate) fn hint(oom: bool, msg: &str) -> &'static str {
    let lower = msg.to_lowercase();
    if oom || lower.contains("out of memory") || lower.contains("outofmemory") {
        "The GPU ran out of memory: lower the VRAM expert tier (--gpu-expert-gb / K3_GPU_GB, \
         0 turns it off), load dense weights at fewer bits (--bits 4 / K3_BITS), or run on the \
         CPU (--backend cpu)."
    } else {
        "This is a bug in k3 or in the GPU driver: please report it with the command line and \
         `k3 devices`; --backend cpu runs without the GPU."
    }
}

#[cfg(test)]
mod tests {
    use super::hint;

    #[test]
    fn out_of_memory_points_at_the_memory_settings() {
        assert!(hint(true, "anything").contains("K3_GPU_GB"));
        assert!(hint(false, "Not enough memory left: Out of memory").contains("--bits 4"));
        assert!(hint(false, "Validation Error").contains("report it"));
    }
}
