# Sourced by the device scripts: unpacks the Vulkan loader carried in .gl/ (see
# lab/README.md) and points it at the NVIDIA driver.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
