// The bandwidth yardstick for the kernel benchmarks: every thread streams vec4<u32> loads
// through the buffer and folds them, so the buffer is read once, coalesced.

override WG: u32 = 256u;

struct ReadParams {
    n4: u32,
    threads: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: ReadParams;
@group(0) @binding(1) var<storage, read> data: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> sink: array<u32>;

@compute @workgroup_size(WG)
fn stream_read(@builtin(global_invocation_id) gid: vec3<u32>) {
    var acc = vec4<u32>(0u);
    for (var i = gid.x; i < p.n4; i += p.threads) {
        acc ^= data[i];
    }
    let v = acc.x ^ acc.y ^ acc.z ^ acc.w;
    // Written only when impossible in practice, so the loads cannot be optimized away.
    if (v == 0x9E3779B9u) {
        sink[gid.x] = v;
    }
}
