// The row-split matvec for a few tokens at once (`dense_few`: TOK tokens, 2..8): a decode
// step of several streams, whose dense matmuls are TOK one-token rows. Run as TOK one-token
// dispatches, every token's workgroups load and decode each weight unit again, and an
// 8-token head spends its time in the L2 re-reads of the weights and of x. Here a lane loads
// and decodes each unit of its rows once and dots it with every token's x, which the
// workgroup stages in tiles of FT units, token after token, each unit padded by a vec4 as in
// matvec_staged.wgsl (a quarter-block's reads then meet no bank conflict). The host gives
// it few lanes a row (`few_tokens_shape`), so a workgroup's rows are many and the staged x
// of every token serves all of them.
//
// Composed after matvec_common.wgsl for the formats that define `few_x4(xb, u, q)` (vec4 q
// of unit u of the x row at vec4 xb, as the format's unit dot takes it), `xu_from(X8)`
// (a staged unit as the format's XU) and `few_dot(WU, DU, XU)` (a unit's dot product from
// its loaded and its decoded form).

// Tokens a workgroup takes (the dispatch's token count).
override TOK: u32 = 2u;
// Units of x staged at a time, for every token (the host sizes it to the workgroup memory).
override FT: u32 = 1u;
// (Named: see gw's size in matvec_common.wgsl.)
override XF_LEN: u32 = FT * TOK * 9u + 1u;
var<workgroup> xf: array<vec4<f32>, XF_LEN>;

// A lane's decoded units of its rows (up to four rows a lane in this kernel).
struct D4 {
    d0: DU,
    d1: DU,
    d2: DU,
    d3: DU,
}

fn decode4(w: W8) -> D4 {
    var d: D4;
    d.d0 = decode_unit(w.w0);
    if (RPL > 1u) {
        d.d1 = decode_unit(w.w1);
    }
    if (RPL > 2u) {
        d.d2 = decode_unit(w.w2);
    }
    if (RPL > 3u) {
        d.d3 = decode_unit(w.w3);
    }
    return d;
}

fn step_few(acc: Acc, w: W8, d: D4, xv: XU) -> Acc {
    var r = acc;
    r.a.x += few_dot(w.w0, d.d0, xv);
    if (RPL > 1u) {
        r.a.y += few_dot(w.w1, d.d1, xv);
    }
    if (RPL > 2u) {
        r.a.z += few_dot(w.w2, d.d2, xv);
    }
    if (RPL > 3u) {
        r.a.w += few_dot(w.w3, d.d3, xv);
    }
    return r;
}

// Staged unit k of token t of the tile: only the format's UV vec4s are read.
fn xf_unit(t: u32, k: u32) -> XU {
    let b = (t * FT + k) * 9u;
    var v: X8;
    v.x0 = xf[b];
    v.x1 = xf[b + 1u];
    v.x2 = xf[b + 2u];
    v.x3 = xf[b + 3u];
    if (UV > 4u) {
        v.x4 = xf[b + 4u];
        v.x5 = xf[b + 5u];
        v.x6 = xf[b + 6u];
        v.x7 = xf[b + 7u];
    }
    return xu_from(v);
}

// Units t0 .. t0 + tn - 1 of every token's x into xf; each lane requests two vec4s before
// storing either.
fn stage_few(t0: u32, tn: u32) {
    let per_tok = tn * UV;
    let n = TOK * per_tok;
    for (var j = r_lid; j < n; j += 2u * WG) {
        let j1 = min(j + WG, n - 1u);
        let i0 = few_item(j, per_tok);
        let i1 = few_item(j1, per_tok);
        let a0 = few_x4(i0.x * p.x_stride4, t0 + i0.y, i0.z);
        let a1 = few_x4(i1.x * p.x_stride4, t0 + i1.y, i1.z);
        xf[(i0.x * FT + i0.y) * 9u + i0.z] = a0;
        if (j + WG < n) {
            xf[(i1.x * FT + i1.y) * 9u + i1.z] = a1;
        }
    }
}

// Item j of a staging round: (token, unit of the tile, vec4 of the unit), each staging round
// holding per_tok vec4s a token.
fn few_item(j: u32, per_tok: u32) -> vec3<u32> {
    let i = j % per_tok;
    return vec3<u32>(j / per_tok, i / UV, i % UV);
}

// A lane's sums of one token, reduced and written; the barrier keeps the next token's
// partial sums (workgroup memory, where a row spans blocks) from overwriting these early.
fn put_token(acc: Acc, j: RowJob, t: u32) {
    write_sums(acc, RPL, j.lane, j.yb + t * p.y_stride, 1u, j.valid);
    workgroupBarrier();
}

// y[t, row0 + r] = W[r] · x[t] for the TOK tokens; wg.y is the row group.
@compute @workgroup_size(WG)
fn dense_few(@builtin(workgroup_id) wg: vec3<u32>, lanes: Lanes) {
    lanes_init(lanes);
    let j = row_job(lanes.lid, wg.y, 0u, 0u, p.row0);
    let zero = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
    var a0 = zero;
    var a1 = zero;
    var a2 = zero;
    var a3 = zero;
    var a4 = zero;
    var a5 = zero;
    var a6 = zero;
    var a7 = zero;
    let last = j.nrows - 1u;
    var u = j.lane;
    var cur = load_w8(j.wrow, last, min(u, p.units - 1u));
    for (var t0 = 0u; t0 < p.units; t0 += FT) {
        let tn = min(FT, p.units - t0);
        // The previous tile's reads are done before it is overwritten.
        workgroupBarrier();
        stage_few(t0, tn);
        workgroupBarrier();
        while (u < t0 + tn) {
            let un = u + LPR;
            let nxt = load_w8(j.wrow, last, min(un, p.units - 1u));
            let d = decode4(cur);
            let k = u - t0;
            a0 = step_few(a0, cur, d, xf_unit(0u, k));
            a1 = step_few(a1, cur, d, xf_unit(1u, k));
            if (TOK > 2u) {
                a2 = step_few(a2, cur, d, xf_unit(2u, k));
            }
            if (TOK > 3u) {
                a3 = step_few(a3, cur, d, xf_unit(3u, k));
            }
            if (TOK > 4u) {
                a4 = step_few(a4, cur, d, xf_unit(4u, k));
            }
            if (TOK > 5u) {
                a5 = step_few(a5, cur, d, xf_unit(5u, k));
            }
            if (TOK > 6u) {
                a6 = step_few(a6, cur, d, xf_unit(6u, k));
            }
            if (TOK > 7u) {
                a7 = step_few(a7, cur, d, xf_unit(7u, k));
            }
            cur = nxt;
            u = un;
        }
    }
    put_token(a0, j, 0u);
    put_token(a1, j, 1u);
    if (TOK > 2u) {
        put_token(a2, j, 2u);
    }
    if (TOK > 3u) {
        put_token(a3, j, 3u);
    }
    if (TOK > 4u) {
        put_token(a4, j, 4u);
    }
    if (TOK > 5u) {
        put_token(a5, j, 5u);
    }
    if (TOK > 6u) {
        put_token(a6, j, 6u);
    }
    if (TOK > 7u) {
        put_token(a7, j, 7u);
    }
}
