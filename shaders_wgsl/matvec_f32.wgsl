// f32 weights: a unit is one vec4 (4 columns).

@group(0) @binding(3) var<storage, read> w: array<vec4<f32>>;

struct XU {
    x0: vec4<f32>,
}

const UV: u32 = 1u;

fn load_x(xb: u32, u: u32) -> XU {
    let b = xb + u * UV;
    return XU(x[b]);
}

struct WU {
    q: vec4<f32>,
}

fn load_w(wrow: u32, u: u32) -> WU {
    return WU(w[wrow * p.units + u]);
}

alias DU = vec4<f32>;

fn decode_unit(wu: WU) -> DU {
    return wu.q;
}

fn decoded_dot(du: DU, xv: XU) -> f32 {
    return dot(du, xv.x0);
}

fn unit_dot(wu: WU, xv: XU) -> f32 {
    return decoded_dot(decode_unit(wu), xv);
}

fn stage_unit(wu: WU, r: u32, c: u32) {
    stage4(wu.q, r, c);
}
