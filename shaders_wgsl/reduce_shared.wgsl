// Workgroup reductions through workgroup memory only: the fallback for adapters without
// subgroup operations (and the path tests force to check it).

override WG: u32 = 256u;

struct Lanes {
    @builtin(local_invocation_index) lid: u32,
}

var<workgroup> red_buf: array<f32, 256>;
var<private> r_lid: u32;

fn lanes_init(l: Lanes) {
    r_lid = l.lid;
}

// Sum over aligned segments of `seg` lanes (a power of two dividing WG); every lane of a
// segment gets the segment's sum. Must be called in uniform control flow.
fn seg_sum(v: f32, seg: u32) -> f32 {
    workgroupBarrier();
    red_buf[r_lid] = v;
    workgroupBarrier();
    for (var o = seg >> 1u; o > 0u; o = o >> 1u) {
        if ((r_lid % seg) < o) {
            red_buf[r_lid] += red_buf[r_lid + o];
        }
        workgroupBarrier();
    }
    return red_buf[r_lid - (r_lid % seg)];
}

// Without subgroups each lane is its own "subgroup" of one: callers that sum per subgroup
// and then across subgroups in workgroup memory work unchanged.
fn sub_sum(v: f32) -> f32 {
    return v;
}

fn sub_size() -> u32 {
    return 1u;
}

fn sub_lane() -> u32 {
    return 0u;
}

// Maximum over the whole workgroup, returned to every lane.
fn wg_max(v: f32) -> f32 {
    workgroupBarrier();
    red_buf[r_lid] = v;
    workgroupBarrier();
    for (var o = WG >> 1u; o > 0u; o = o >> 1u) {
        if (r_lid < o) {
            red_buf[r_lid] = max(red_buf[r_lid], red_buf[r_lid + o]);
        }
        workgroupBarrier();
    }
    return red_buf[0];
}

fn wg_sum(v: f32) -> f32 {
    return seg_sum(v, WG);
}
