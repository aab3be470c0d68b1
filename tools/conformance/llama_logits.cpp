// llama_logits: evaluate a prompt of token ids with llama.cpp and write the logits of
// every prompt position as little-endian f32 [positions x vocab].
//
// Built against a llama.cpp checkout by make_fixtures.sh; this is our code, the model
// math is llama.cpp's. Usage:
//   llama_logits MODEL.gguf IDS OUT.f32 [--one-by-one] [--flash-attn] [--dump-dir DIR] [--threads N]
// IDS is a comma-separated list of token ids. --one-by-one feeds one token per
// llama_decode call (the recurrent path) instead of the whole prompt in one batch (the
// chunked path). --dump-dir writes every graph tensor whose name starts with one of
// the prefixes in DUMP_PREFIXES as DIR/<name>.f32 (f32 rows, all batch positions),
// for localizing a disagreement layer by layer.

#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

const char * const DUMP_PREFIXES[] = {
    "inp_embd", "attn_norm", "kda_out", "mla_out", "prefix_sum_attn", "ffn_norm",
    "ffn_out", "ffn_moe_out", "l_out", "result_norm", "res_probs", "kda_scan_out",
    "kda_q_conv", "kda_k_conv", "kda_v_conv", "kda_g1", "kda_beta", "ffn_moe_logits",
};

struct DumpState {
    std::string dir;
    int call = 0;  // index of the llama_decode call, so one-by-one dumps do not collide
};

bool wanted(const char * name) {
    for (const char * p : DUMP_PREFIXES) {
        const size_t n = std::strlen(p);
        if (std::strncmp(name, p, n) != 0) {
            continue;
        }
        // "prefix" or "prefix-<layer>" only: views and reshapes get suffixed names.
        if (name[n] == '\0') {
            return true;
        }
        if (name[n] != '-' || name[n + 1] == '\0') {
            continue;
        }
        const char * d = name + n + 1;
        while (*d >= '0' && *d <= '9') {
            ++d;
        }
        if (*d == '\0') {
            return true;
        }
    }
    return false;
}

// ggml_backend_sched_eval_callback: first asked whether we want a tensor, then handed it.
bool dump_cb(ggml_tensor * t, bool ask, void * user) {
    auto * st = static_cast<DumpState *>(user);
    if (!wanted(t->name)) {
        return false;
    }
    if (ask) {
        return true;
    }
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
        std::fprintf(stderr, "dump: skipping %s (not contiguous f32)\n", t->name);
        return true;
    }
    std::vector<float> buf(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
    const std::string path = st->dir + "/" + t->name + ".call" + std::to_string(st->call) + ".f32";
    FILE * f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) {
        std::fprintf(stderr, "dump: cannot write %s\n", path.c_str());
        return false;
    }
    std::fwrite(buf.data(), sizeof(float), buf.size(), f);
    std::fclose(f);
    return true;
}

std::vector<llama_token> parse_ids(const char * s) {
    std::vector<llama_token> ids;
    const char * p = s;
    while (*p != '\0') {
        char * end = nullptr;
        const long v = std::strtol(p, &end, 10);
        if (end == p) {
            std::fprintf(stderr, "IDS %s: expected comma-separated integers\n", s);
            std::exit(2);
        }
        ids.push_back(static_cast<llama_token>(v));
        p = (*end == ',') ? end + 1 : end;
    }
    return ids;
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        std::fputs(text, stderr);
    }
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL.gguf IDS OUT.f32 [--one-by-one] [--flash-attn] [--dump-dir DIR] [--threads N]\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    const std::vector<llama_token> ids = parse_ids(argv[2]);
    const char * out_path = argv[3];
    bool one_by_one = false;
    DumpState dump;
    int threads = 1;
    bool flash_attn = false;
    for (int i = 4; i < argc; ++i) {
        if (std::strcmp(argv[i], "--one-by-one") == 0) {
            one_by_one = true;
        } else if (std::strcmp(argv[i], "--dump-dir") == 0 && i + 1 < argc) {
            dump.dir = argv[++i];
        } else if (std::strcmp(argv[i], "--flash-attn") == 0) {
            flash_attn = true;
        } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = std::atoi(argv[++i]);
        } else {
            std::fprintf(stderr, "unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    if (ids.empty()) {
        std::fprintf(stderr, "IDS is empty\n");
        return 2;
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", model_path);
        return 1;
    }

    const int n = static_cast<int>(ids.size());
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n < 64 ? 64 : n;
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = cp.n_ctx;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.no_perf = true;
    // The default F16 cache rounds MLA's latent cache to 11 bits (~1e-4 on the logits of
    // a random model); the fixtures compare math, so keep every cached value in f32.
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (!dump.dir.empty()) {
        cp.cb_eval = dump_cb;
        cp.cb_eval_user_data = &dump;
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        std::fprintf(stderr, "cannot create a context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    std::vector<float> logits(static_cast<size_t>(n) * n_vocab);
    const int step = one_by_one ? 1 : n;
    llama_batch batch = llama_batch_init(step, 0, 1);
    for (int start = 0; start < n; start += step) {
        batch.n_tokens = 0;
        for (int i = start; i < start + step; ++i) {
            const int j = batch.n_tokens++;
            batch.token[j] = ids[i];
            batch.pos[j] = i;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = 1;  // logits for every position, not only the last
        }
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llama_decode failed at position %d\n", start);
            return 1;
        }
        for (int j = 0; j < batch.n_tokens; ++j) {
            const float * row = llama_get_logits_ith(ctx, j);
            if (row == nullptr) {
                std::fprintf(stderr, "no logits for position %d\n", start + j);
                return 1;
            }
            std::memcpy(&logits[static_cast<size_t>(start + j) * n_vocab], row, sizeof(float) * n_vocab);
        }
        dump.call++;
    }
    llama_batch_free(batch);

    FILE * f = std::fopen(out_path, "wb");
    if (f == nullptr) {
        std::fprintf(stderr, "cannot write %s\n", out_path);
        return 1;
    }
    std::fwrite(logits.data(), sizeof(float), logits.size(), f);  // x86/arm hosts: little-endian
    std::fclose(f);
    std::fprintf(stderr, "wrote %d x %d logits to %s\n", n, n_vocab, out_path);

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
