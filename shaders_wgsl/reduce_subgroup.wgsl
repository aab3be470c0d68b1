// Workgroup reductions through subgroup operations (prepended to a kernel when the adapter
// has SUBGROUP). The subgroup size is read at run time, never assumed: segments wider than
// one subgroup finish through workgroup memory.

override WG: u32 = 256u;

struct Lanes {
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
}

var<workgroup> red_buf: array<f32, 256>;
var<private> r_lid: u32;
var<private> r_sg_size: u32;
var<private> r_sg_lane: u32;

fn lanes_init(l: Lanes) {
    r_lid = l.lid;
    r_sg_size = l.sg_size;
    r_sg_lane = l.sg_lane;
}

// Sum over aligned segments of `seg` lanes (a power of two dividing WG); every lane of a
// segment gets the segment's sum. Must be called in uniform control flow.
fn seg_sum(v: f32, seg: u32) -> f32 {
    var s = v;
    let inside = min(seg, r_sg_size);
    for (var o = inside >> 1u; o > 0u; o = o >> 1u) {
        s += subgroupShuffleXor(s, o);
    }
    let per = max(seg / r_sg_size, 1u);
    workgroupBarrier();
    if (r_sg_lane == 0u) {
        red_buf[r_lid / r_sg_size] = s;
    }
    workgroupBarrier();
    if (per == 1u) {
        return s;
    }
    let base = (r_lid / seg) * per;
    var t = 0.0;
    for (var i = 0u; i < per; i++) {
        t += red_buf[base + i];
    }
    return t;
}

// Sum over the lane's subgroup, to every lane, with no workgroup barrier (callable per row
// inside a loop); `sub_size` and `sub_lane` place the lane.
fn sub_sum(v: f32) -> f32 {
    var s = v;
    for (var o = r_sg_size >> 1u; o > 0u; o = o >> 1u) {
        s += subgroupShuffleXor(s, o);
    }
    return s;
}

fn sub_size() -> u32 {
    return r_sg_size;
}

fn sub_lane() -> u32 {
    return r_sg_lane;
}

// Maximum over the whole workgroup, returned to every lane.
fn wg_max(v: f32) -> f32 {
    var s = v;
    for (var o = r_sg_size >> 1u; o > 0u; o = o >> 1u) {
        s = max(s, subgroupShuffleXor(s, o));
    }
    let n = max(WG / r_sg_size, 1u);
    workgroupBarrier();
    if (r_sg_lane == 0u) {
        red_buf[r_lid / r_sg_size] = s;
    }
    workgroupBarrier();
    var t = red_buf[0];
    for (var i = 1u; i < n; i++) {
        t = max(t, red_buf[i]);
    }
    return t;
}

fn wg_sum(v: f32) -> f32 {
    return seg_sum(v, WG);
}
