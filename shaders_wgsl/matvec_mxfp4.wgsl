// Native MXFP4 weights: E2M1 nibbles (low nibble = even column) with one E8M0 exponent per
// 32 columns, decoded here and never on the host. A unit is one scale block: 32 columns in
// one vec4<u32>. E8M0 is the f32 with bit pattern s << 23 (s = 0 gives 0, s = 255 gives
// +inf), exactly as the CPU decodes it; for s = 255 the scale is applied per element so
// that 0 · inf stays NaN as on the CPU.

@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scales: array<u32>;
@group(0) @binding(5) var<storage, read> rt: array<u32>;

const UV: u32 = 8u;

struct Unit {
    v: array<vec4<f32>, UV>,
    s: f32,
}

const SH_LO: vec4<u32> = vec4<u32>(0u, 4u, 8u, 12u);
const SH_HI: vec4<u32> = vec4<u32>(16u, 20u, 24u, 28u);

// E2M1 magnitudes ≥ 2 are the top of an f32 exponent and mantissa; code 1 is 0.5.
fn e2m1(n: vec4<u32>) -> vec4<f32> {
    let mag = n & vec4<u32>(7u);
    let normal = (mag << vec4<u32>(22u)) + vec4<u32>(126u << 23u);
    let small = select(vec4<u32>(0u), vec4<u32>(0x3F000000u), mag == vec4<u32>(1u));
    let bits = select(small, normal, mag >= vec4<u32>(2u));
    return bitcast<vec4<f32>>(bits | ((n & vec4<u32>(8u)) << vec4<u32>(28u)));
}

fn load_unit(wrow: u32, u: u32) -> Unit {
    let q = w[wrow * p.units + u];
    let si = wrow * p.groups + u;
    let s = (scales[si >> 2u] >> ((si & 3u) * 8u)) & 0xFFu;
    let sc = bitcast<f32>(s << 23u);
    var v = array<vec4<f32>, UV>(
        e2m1(vec4<u32>(q.x) >> SH_LO), e2m1(vec4<u32>(q.x) >> SH_HI),
        e2m1(vec4<u32>(q.y) >> SH_LO), e2m1(vec4<u32>(q.y) >> SH_HI),
        e2m1(vec4<u32>(q.z) >> SH_LO), e2m1(vec4<u32>(q.z) >> SH_HI),
        e2m1(vec4<u32>(q.w) >> SH_LO), e2m1(vec4<u32>(q.w) >> SH_HI),
    );
    if (s == 255u) {
        for (var k = 0u; k < UV; k++) {
            v[k] = v[k] * sc;
        }
        return Unit(v, 1.0);
    }
    return Unit(v, sc);
}

// Batched experts: work item item0 + wg.y = (expert slot, first pair, pair count ≤ TOK) from `rt`;
// the pair's input row comes from the gather table at rt[map_off + pair]; the output is
// row `pair` of y ([pairs, rows]).
@compute @workgroup_size(WG)
fn moe(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let lane = lanes.lid % LPR;
    let row = wg.x * (WG / LPR) + lanes.lid / LPR;
    let rr = min(row, p.rows - 1u);
    let item = p.item0 + wg.y;
    let slot = rt[3u * item];
    let first = rt[3u * item + 1u];
    let nt = rt[3u * item + 2u];
    var xoff: array<u32, TMAX>;
    var yoff: array<u32, TMAX>;
    for (var t = 0u; t < TOK; t++) {
        let pr = first + min(t, nt - 1u);
        xoff[t] = rt[p.map_off + pr] * p.x_stride4;
        yoff[t] = pr * p.y_stride + rr;
    }
    let acc = lane_partials(slot * p.rows + rr, xoff, lane);
    finish(acc, lane, row < p.rows, yoff, nt);
}
