// Runs a model's trunk and its MTP (NextN) head through llama.cpp's own
// graphs and dumps the numbers: a reference for fle_engine.mtp.
//
// usage:  llama_mtp_dump MODEL OUT_DIR N_THREADS < tokens
// stdin:  the token ids t_0 .. t_{n-1}, whitespace-separated (n >= 2)
// OUT_DIR (must exist) receives raw little-endian float32, row-major:
//   trunk_logits.f32     [n, n_vocab]   trunk logits of every position
//   h_nextn.f32          [n, n_embd]    the trunk's h_nextn of every position
//                                       (the post-output_norm hidden that feeds
//                                       both the LM head and the MTP head)
//   mtp_logits.f32       [n-1, n_vocab] head logits of the pairs (h_j, t_{j+1}),
//                                       j = 0 .. n-2, decoded as one batch at
//                                       positions j + 1 into an empty head cache
//   mtp_h_nextn.f32      [n-1, n_embd]  the head's own h_nextn of those pairs
//                                        (fed back by multi-token drafting)
//   mtp_logits_hook.f32  [n, n_vocab]   the same head over the batch that
//                                       common/speculative.cpp's MTP catch-up
//                                       decodes for a prompt: row k pairs t_k
//                                       with h_{k-1} at position k, row 0 with
//                                       an all-zero hidden state
//   meta.txt             "n n_vocab n_embd"
// Errors: a message on stderr and exit status 1.
//
// How llama.cpp drives the head (the facts this program follows):
// * One model loaded with load_mtp = true serves two contexts: the trunk
//   (LLAMA_CONTEXT_TYPE_DEFAULT, whose graph skips the NextN block) and the
//   head (LLAMA_CONTEXT_TYPE_MTP, graph llama_model_qwen3next::graph_mtp,
//   with a plain KV cache holding only the NextN layer), as
//   common_speculative_init_result does in common/speculative.cpp.
// * llama_set_embeddings_nextn(ctx, true, masked = false) makes the trunk
//   keep h_nextn for every token of the batch, read densely by
//   llama_get_embeddings_nextn (src/llama-ext.h).
// * The head's hidden-state input travels as the token's embedding
//   (llama_batch_ext_set_embd_token after llama_batch_ext_add_token): that
//   is what common_batch::get_sub_batch sends and what
//   llm_graph_input_embd_h::set_input copies into the head's h input
//   (src/llama-graph.cpp). llama_batch_ext_set_embd_state is a stub that
//   returns false in this version (src/llama-batch.cpp).
// * Positions: common_speculative_impl_draft_mtp::process pairs the token at
//   position p + 1 with h_p ("pair (h_p, x_{p+1}) at MTP pos p+1"), and
//   draft() continues that way; the first token of a prompt is paired with a
//   zero-initialised pending_h.
// The caches are F32 and flash attention is off, so the numbers are as exact
// as the CPU backend computes them.

#include "llama.h"
#include "llama-ext.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

[[noreturn]] void die(const std::string & msg) {
    std::fprintf(stderr, "llama_mtp_dump: %s\n", msg.c_str());
    std::exit(1);
}

void write_f32(const std::string & path, const float * data, size_t count) {
    FILE * f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(data, sizeof(float), count, f) != count || std::fclose(f) != 0) {
        die("cannot write " + path);
    }
}

llama_context * make_context(llama_model * model, llama_context_type type, int n, int n_threads,
                             llama_context * other) {
    llama_context_params cp = llama_context_default_params();
    cp.ctx_type        = type;
    cp.n_ctx           = (uint32_t) n;
    cp.n_batch         = (uint32_t) n;  // one batch, one ubatch
    cp.n_ubatch        = (uint32_t) n;
    cp.n_seq_max       = 1;
    cp.n_threads       = n_threads;
    cp.n_threads_batch = n_threads;
    cp.type_k          = GGML_TYPE_F32;
    cp.type_v          = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf         = true;
    if (type == LLAMA_CONTEXT_TYPE_MTP) {
        cp.n_rs_seq  = 0;      // as common_speculative_init_result sets them
        cp.ctx_other = other;
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        die(type == LLAMA_CONTEXT_TYPE_MTP ? "cannot create the MTP context" : "cannot create the trunk context");
    }
    return ctx;
}

// decodes rows (tokens[k], h_rows[k] or zeros when null, pos[k]) as one batch
// in an emptied head cache and returns the logits of every row; with h_out,
// also the head's own h_nextn of every row (what multi-token drafting feeds
// back as the next row's hidden state)
std::vector<float> run_head(llama_context * ctx, const std::vector<llama_token> & tokens,
                            const std::vector<const float *> & h_rows, const std::vector<llama_pos> & pos,
                            int n_embd, int n_vocab, std::vector<float> * h_out = nullptr) {
    llama_memory_clear(llama_get_memory(ctx), true);
    const std::vector<float> zeros(n_embd, 0.0f);
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    const int m = (int) tokens.size();
    for (int k = 0; k < m; ++k) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[k]);
        if (idx != k) {
            die("llama_batch_ext_add_token failed (" + std::to_string(idx) + ")");
        }
        const float * h = h_rows[k] ? h_rows[k] : zeros.data();
        if (!llama_batch_ext_set_pos(batch, idx, &pos[k]) ||
            !llama_batch_ext_set_embd_token(batch, idx, {h, 1, (size_t) n_embd}) ||
            !llama_batch_ext_set_output_logits(batch, idx, true)) {
            die("cannot fill the MTP batch");
        }
    }
    const int32_t rc = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch);
    llama_batch_ext_free(batch);
    if (rc != 0) {
        die("llama_process (MTP) returned " + std::to_string(rc));
    }
    std::vector<float> out((size_t) m * n_vocab);
    for (int k = 0; k < m; ++k) {
        const float * row = llama_get_logits_ith(ctx, k);
        if (!row) {
            die("no MTP logits for row " + std::to_string(k));
        }
        std::memcpy(out.data() + (size_t) k * n_vocab, row, sizeof(float) * n_vocab);
    }
    if (h_out) {
        const float * h = llama_get_embeddings_nextn(ctx);
        if (!h) {
            die("the MTP context kept no h_nextn");
        }
        h_out->assign(h, h + (size_t) m * n_embd);
    }
    return out;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc != 4) {
        die("usage: llama_mtp_dump MODEL OUT_DIR N_THREADS < tokens");
    }
    const std::string model_path = argv[1];
    const std::string out_dir    = argv[2];
    const int         n_threads  = std::max(1, std::atoi(argv[3]));

    std::vector<llama_token> tokens;
    for (long t; std::cin >> t;) {
        tokens.push_back((llama_token) t);
    }
    if (!std::cin.eof()) {
        die("stdin must hold whitespace-separated token ids");
    }
    const int n = (int) tokens.size();
    if (n < 2) {
        die("need at least two tokens");
    }

    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.load_mtp      = true;
    mp.n_gpu_layers  = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) {
        die("cannot load " + model_path);
    }
    if (llama_model_n_layer_nextn(model) < 1) {
        die(model_path + " has no MTP layer");
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_embd  = llama_model_n_embd_out(model);

    // (a) the trunk over all tokens, logits and h_nextn for every position
    llama_context * ctx_tgt = make_context(model, LLAMA_CONTEXT_TYPE_DEFAULT, n, n_threads, nullptr);
    llama_set_embeddings_nextn(ctx_tgt, true, /*masked*/ false);
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i]     = tokens[i];
        batch.pos[i]       = i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i]    = 1;
    }
    batch.n_tokens = n;
    if (const int32_t rc = llama_decode(ctx_tgt, batch); rc != 0) {
        die("llama_decode (trunk) returned " + std::to_string(rc));
    }
    llama_batch_free(batch);

    std::vector<float> logits((size_t) n * n_vocab);
    for (int i = 0; i < n; ++i) {
        const float * row = llama_get_logits_ith(ctx_tgt, i);
        if (!row) {
            die("no trunk logits for position " + std::to_string(i));
        }
        std::memcpy(logits.data() + (size_t) i * n_vocab, row, sizeof(float) * n_vocab);
    }
    const float * h = llama_get_embeddings_nextn(ctx_tgt);
    if (!h) {
        die("the trunk kept no h_nextn");
    }
    const std::vector<float> h_nextn(h, h + (size_t) n * n_embd);

    // (b) the head: a context of type MTP on the same model
    llama_context * ctx_mtp = make_context(model, LLAMA_CONTEXT_TYPE_MTP, n, n_threads, ctx_tgt);
    llama_set_embeddings_nextn(ctx_mtp, true, /*masked*/ false);

    std::vector<llama_token>   pair_tok;
    std::vector<const float *> pair_h;
    std::vector<llama_pos>     pair_pos;
    for (int j = 0; j + 1 < n; ++j) {
        pair_tok.push_back(tokens[j + 1]);
        pair_h.push_back(h_nextn.data() + (size_t) j * n_embd);
        pair_pos.push_back(j + 1);
    }
    std::vector<float> mtp_h;
    const std::vector<float> mtp = run_head(ctx_mtp, pair_tok, pair_h, pair_pos, n_embd, n_vocab, &mtp_h);

    std::vector<const float *> hook_h = {nullptr};
    std::vector<llama_pos>     hook_pos;
    hook_h.insert(hook_h.end(), pair_h.begin(), pair_h.end());
    for (int k = 0; k < n; ++k) {
        hook_pos.push_back(k);
    }
    const std::vector<float> hook = run_head(ctx_mtp, tokens, hook_h, hook_pos, n_embd, n_vocab);

    write_f32(out_dir + "/trunk_logits.f32", logits.data(), logits.size());
    write_f32(out_dir + "/h_nextn.f32", h_nextn.data(), h_nextn.size());
    write_f32(out_dir + "/mtp_logits.f32", mtp.data(), mtp.size());
    write_f32(out_dir + "/mtp_logits_hook.f32", hook.data(), hook.size());
    write_f32(out_dir + "/mtp_h_nextn.f32", mtp_h.data(), mtp_h.size());
    FILE * meta = std::fopen((out_dir + "/meta.txt").c_str(), "w");
    if (!meta || std::fprintf(meta, "%d %d %d\n", n, n_vocab, n_embd) < 0 || std::fclose(meta) != 0) {
        die("cannot write " + out_dir + "/meta.txt");
    }

    llama_free(ctx_mtp);
    llama_free(ctx_tgt);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
