/*
 * node.c - the decode node's sequences: reservation, KV arrival, continuous batching,
 * sampling and stop conditions.
 *
 * A sequence goes RESERVED (KV slots taken, receives posted) -> STARTED (first token known,
 * waiting for its KV) -> RUNNING (in the batch) -> released. Every state has a way out: the
 * KV deadline, the request deadline, cancel, errors; releasing cancels outstanding receives
 * before the cache is freed, so no transfer can write into freed memory.
 */
#include "decode_node/decode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

enum { SEQ_FREE = 0, SEQ_RESERVED, SEQ_STARTED, SEQ_RUNNING };

#define PDM__MAX_STOPS 8
#define PDM__TEXT_CAP (1 << 16)

/* One of n samples (OpenAI's n, nsamp.h): what it has generated besides its tokens (kept by
 * the nsamp group) and how it ended. */
typedef struct {
    char *text;             /* [PDM__TEXT_CAP] its text so far */
    size_t text_len;
    pdm_detok_t detok;
    pdm_gmatch_t *gm;       /* its structured-output matcher (its sampler masks with it), or
                             * NULL */
    const char *finish;     /* "eos", "length", "stop" once it ended; NULL while it runs */
} pdm__sample_t;

typedef struct {
    int state;
    uint64_t id;
    uint32_t attempt;
    int32_t n_prompt, max_new;
    pdm_kv_cache_t *cache;
    pdm_kvoff_t *off;  /* head-wise offload store owning `cache`, or NULL */
    pdm_kvt_stream_rx_t *rx;
    int kv_done;
    pdm_sampler_t *sampler;
    int32_t next;      /* input token of the next step */
    int32_t *tokens;   /* [max_new] generated (first token included) */
    int n_tokens;
    char *stops[PDM__MAX_STOPS];
    int n_stops;
    char *text;        /* [PDM__TEXT_CAP] generated text so far */
    size_t text_len;
    pdm_detok_t detok;
    double deadline, t_start, kv_seconds, step_total;
    int steps;
    uint64_t kv_bytes;
    int64_t kv_slots;          /* KV token slots reserved for it (stage_slots included) */
    void *stage;               /* windowed layers: [n_windowed * n_kv_heads][2][n_prompt] rows
                                * the prompt's KV stream lands in (then only the last S - 1
                                * are kept), or NULL */
    void **rx_k, **rx_v;       /* [n_layers * n_kv_heads] where each head's prompt rows land:
                                * the cache's arrays, or staging for windowed layers */
    int64_t stage_slots;       /* KV token slots the staging counts until the KV arrives */
    int beam_width;            /* 0: sampling; else a beam search (beam.c, beam_search.c) */
    pdm_beam_params_t beam_p;
    pdm_beam_kv_t *beam_kv;    /* segmented response KV over `cache` (the shared prompt) */
    pdm_beam_search_t *beam;
    int n_samples;             /* OpenAI's n > 1: samples over beam_kv (nsamp.h); else 0. Its
                                * KV is reserved as a beam search of width n_samples */
    pdm_nsamp_t *ns;           /* the samples' samplers and tokens (after start) */
    pdm__sample_t *smp;        /* [n_samples] */
    int prime_given;           /* n samples: local_logits holds the prefill side's logits of
                                * the last prompt token (no priming step) */
    int forced;                /* n samples resuming a migrated choice (n_samples 1, n_done >
                                * 0): its delivered tokens hist[0, n_done) replayed so far */
    int ignore_eos;      /* end-of-generation tokens do not end the sequence */
    int local;           /* prefilled by this node (no KV stream) */
    float *local_logits; /* local: [n_vocab] logits of the last prompt token */
    int32_t *prompt;     /* [n_prompt] its tokens, or NULL (then it never joins the pool) */
    int32_t cached;      /* prompt tokens whose KV came from the pool */
    int32_t *hist;       /* [n_done + max_new] after a migration: the n_done completion tokens
                          * delivered before it, then `tokens` again; NULL otherwise */
    int n_done;
    pdm_token_logprobs_t first_lp; /* log-probabilities of the first token (logprobs) */
    int want_lp;         /* sp.logprobs >= 0 */
    int first_lp_known;  /* first_lp is set (sampled here, or sent with the first token) */
    pdm_grammar_t *grammar; /* structured output (sp.json_schema), or NULL */
    pdm_gmatch_t *gm;       /* its state after the completion's tokens (the sampler masks with
                             * it; pdm__append feeds it) */
} pdm__seq_t;

/* A stream whose sequence went before its KV was all in (cancelled, failed, its router gone):
 * the ranks may still be sending it. Its blocks are received and thrown away until `until`,
 * so that a rank blocked on a rendezvous send completes at once instead of waiting out its
 * own timeout - which stalled its whole prefill group for 30 s (test_ha.py in CI: a router
 * killed while its prompt still streamed). */
#define PDM__DEAD_STREAMS 256
typedef struct {
    uint64_t id;
    uint32_t attempt;
    double until; /* 0: a free entry */
} pdm__dead_stream_t;

/* A finished sequence kept for its prefix: its tokens and the KV of each of them. */
typedef struct {
    int32_t *tokens;
    int32_t n;
    pdm_kv_cache_t *cache;
    uint64_t stamp;     /* last use (least recently used goes first) */
    uint8_t (*keys)[32]; /* [n_keys] the router's block keys of its whole blocks, or NULL */
    int n_keys;
    uint64_t *ck;       /* [n_layers * n_kv_heads] XXH3-64 of each head's K then V rows
                         * [0, n) (kvtransfer/checksum.c), checked before any reuse */
    void *file;         /* second tier (cache NULL then): [n_layers * n_kv_heads][2][n] rows,
                         * each head's K then V, in the pool's file tier; NULL in RAM */
    size_t file_bytes;
} pdm__pooled_t;

/* An entry in use, in either tier. */
static int pdm__used(const pdm__pooled_t *e)
{
    return e->cache || e->file;
}

struct pdm_decode_node {
    const pdm_model_t *model;
    pdm_kvt_t *kvt;
    pdm_decode_params_t p;
    pdm_model_ctx_t *ctx;
    pdm_act_t act;
    pdm__seq_t *seqs; /* [max_sequences] */
    float *logits;    /* [max_batch][n_vocab] outputs of one step */
    int64_t kv_used;  /* token slots reserved */
    int rr;           /* round-robin start of the next batch */
    int32_t eog[16];  /* end-of-generation token ids (beam search) */
    int n_eog;
    pdm_kvoff_engine_t *offload; /* head-wise KV offload (p.offload), or NULL */
    pdm__pooled_t *pool;         /* [pool_cap] the prefix pool (decode.h), both tiers */
    int pool_cap;                /* max_sequences, twice that with a file tier */
    pdm_kvtier_t *pool_tier;     /* the pool's second tier (p.pool_file_tier), or NULL */
    int64_t pool_file_slots;     /* tokens its entries hold there */
    int64_t pool_slots;          /* KV slots its caches hold */
    uint64_t pool_stamp;
    pdm_decode_pool_stats_t pool_st;
    pdm_vocab_trie_t *trie;      /* the vocabulary's byte trie, built at the first request with
                                  * a json_schema and shared by every matcher */
    /* KV events (decode.h): the router's key parameters, and the bounded event ring */
    int has_keys;
    pdm_prefix_key_params_t kp;
    char kp_model[128];
    pdm_decode_kv_event_t *ev; /* [PDM_DECODE_KVEV_QUEUE] */
    int ev_head, ev_count;
    int ev_reset;              /* the next drained batch says reset */
    const pdm__pooled_t *pool_pending; /* pdm__pool_put: the sequence being pooled, whose
                                        * blocks evictions meanwhile keep in the index */
    pdm__dead_stream_t dead[PDM__DEAD_STREAMS]; /* a ring; the oldest entry is reused (more
                                                 * dropped streams than that in kv_timeout:
                                                 * their senders wait out their timeout) */
    int dead_next;
};

void pdm_decode_params_default(pdm_decode_params_t *p)
{
    p->threads = 1;
    p->max_batch = 16;
    p->max_sequences = 64;
    p->kv_budget = 1 << 18;
    p->kv_dtype = PDM_DT_F16;
    p->kv_timeout = 30;
    pdm_beam_params_default(&p->beam);
    p->offload = NULL;
    p->kv_window = 2; /* the Qualcomm note's no-copy reserve, 2(S-1) */
    p->pool_tokens = 0; /* (was left unset: tests that did not set it read garbage) */
    p->fault_corrupt_pool = 0;
    p->pool_file_tier = NULL;
    p->pool_file_tokens = 0;
}

int pdm_decode_node_create(const pdm_model_t *model, pdm_kvt_t *kvt,
                           const pdm_decode_params_t *p, pdm_decode_node_t **out)
{
    if (p->threads < 1 || p->max_batch < 1 || p->max_sequences < 1 || p->kv_budget < 1 ||
        (p->kv_dtype != PDM_DT_F16 && p->kv_dtype != PDM_DT_F32 && p->kv_dtype != PDM_DT_I8) ||
        !(p->kv_timeout > 0) || pdm_beam_params_check(&p->beam) ||
        (p->kv_window != 0 && !(p->kv_window >= 1.5 && p->kv_window <= 8)))
        return pdm_error_set(PDM_EINVAL, "decode node: bad parameters");
    pdm_decode_node_t *n = calloc(1, sizeof(*n));
    if (!n) return pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    n->model = model;
    n->kvt = kvt;
    n->p = *p;
    int st = pdm_model_ctx_create(model, p->threads, p->max_batch, &n->ctx);
    if (!st) st = pdm_act_alloc(&model->hp, p->max_batch, &n->act);
    if (!st && !(n->seqs = calloc((size_t)p->max_sequences, sizeof(pdm__seq_t))))
        st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    if (!st && !(n->logits = malloc(sizeof(float) * (size_t)p->max_batch * model->hp.n_vocab)))
        st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    n->pool_cap = p->max_sequences * (p->pool_file_tier && p->pool_tokens > 0 ? 2 : 1);
    if (!st && !(n->pool = calloc((size_t)n->pool_cap, sizeof(pdm__pooled_t))))
        st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    /* the file tier's own budget is counted in tokens here (pool_file_tokens) */
    if (!st && p->pool_file_tier && p->pool_tokens > 0)
        st = pdm_kvtier_create(p->pool_file_tier, 0, &n->pool_tier);
    if (!st && p->pool_tokens > 0 &&
        !(n->ev = malloc(sizeof(pdm_decode_kv_event_t) * PDM_DECODE_KVEV_QUEUE)))
        st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    if (!st && p->offload) st = pdm_kvoff_engine_create(p->offload, &n->offload);
    n->p.offload = NULL; /* the engine keeps its own copy */
    if (st) {
        pdm_decode_node_destroy(n);
        return st;
    }
    for (uint32_t t = 0; model->tokenizer && t < model->hp.n_vocab && n->n_eog < 16; t++)
        if (pdm_tokenizer_is_eog(model->tokenizer, (int32_t)t)) n->eog[n->n_eog++] = (int32_t)t;
    *out = n;
    return PDM_OK;
}

/* ---- the prefix pool (decode.h) --------------------------------------------------------- */

static void pdm__kvev_snapshot(pdm_decode_node_t *n);

/* Queues one event; a full ring is replaced by a snapshot (decode.h). */
static void pdm__kvev_push_tier(pdm_decode_node_t *n, int kind, int tier, int count,
                               const uint8_t key[32])
{
    if (!n->ev || !n->has_keys) return;
    if (count && kind == PDM_DECODE_KVEV_STORED) n->pool_st.blocks++;
    else if (count && n->pool_st.blocks) n->pool_st.blocks--;
    if (n->ev_count == PDM_DECODE_KVEV_QUEUE) {
        pdm__kvev_snapshot(n);
        return; /* the snapshot reflects this change already */
    }
    pdm_decode_kv_event_t *e = &n->ev[(n->ev_head + n->ev_count++) % PDM_DECODE_KVEV_QUEUE];
    e->kind = kind;
    e->tier = tier;
    memcpy(e->key, key, 32);
}

/* An event that changes which blocks the pool holds (RAM tier for STORED). */
static void pdm__kvev_push(pdm_decode_node_t *n, int kind, const uint8_t key[32])
{
    pdm__kvev_push_tier(n, kind, 1, 1, key);
}

/* Whether a pooled sequence other than `skip` (or the not yet pooled `extra`) holds key. */
static int pdm__pool_holds(const pdm_decode_node_t *n, const pdm__pooled_t *skip,
                           const pdm__pooled_t *extra, const uint8_t key[32])
{
    for (int i = 0; i <= n->pool_cap; i++) {
        const pdm__pooled_t *e = i < n->pool_cap ? &n->pool[i] : extra;
        if (!e || e == skip || !pdm__used(e) || !e->keys) continue;
        for (int k = 0; k < e->n_keys; k++)
            if (!memcmp(e->keys[k], key, 32)) return 1;
    }
    return 0;
}

/* 2 when a RAM entry of the pool holds key, 1 when only file-tier entries do, else 0. */
static int pdm__pool_holds_tier(const pdm_decode_node_t *n, const uint8_t key[32])
{
    int t = 0;
    for (int i = 0; i < n->pool_cap && t < 2; i++) {
        const pdm__pooled_t *e = &n->pool[i];
        for (int k = 0; pdm__used(e) && e->keys && k < e->n_keys; k++)
            if (!memcmp(e->keys[k], key, 32)) {
                t = PDM_MAX(t, e->cache ? 2 : 1);
                break;
            }
    }
    return t;
}

/* Distinct block keys the pool holds (counted anew when the keys change; the events keep
 * pool_st.blocks up to date after that). */
static uint64_t pdm__pool_blocks(const pdm_decode_node_t *n)
{
    uint64_t k = 0;
    for (int i = 0; i < n->pool_cap; i++) {
        const pdm__pooled_t *e = &n->pool[i];
        for (int j = 0; pdm__used(e) && e->keys && j < e->n_keys; j++) {
            int earlier = 0; /* counted with an earlier entry */
            for (int h = 0; h < i && !earlier; h++) {
                const pdm__pooled_t *o = &n->pool[h];
                for (int m = 0; pdm__used(o) && o->keys && m < o->n_keys && !earlier; m++)
                    earlier = !memcmp(o->keys[m], e->keys[j], 32);
            }
            k += !earlier;
        }
    }
    return k;
}

/* The ring emptied and refilled with every key the pool holds, behind a reset. */
static void pdm__kvev_snapshot(pdm_decode_node_t *n)
{
    n->ev_head = n->ev_count = 0;
    n->ev_reset = 1;
    for (int pass = 0; pass < 2; pass++) /* file tier first: a block in both is in RAM */
        for (int i = 0; i < n->pool_cap; i++) {
            const pdm__pooled_t *e = &n->pool[i];
            if (!(pass ? e->cache != NULL : e->file != NULL)) continue;
            for (int k = 0; e->keys && k < e->n_keys; k++) {
                if (n->ev_count == PDM_DECODE_KVEV_QUEUE) return; /* the rest goes unindexed */
                pdm_decode_kv_event_t *ev = &n->ev[n->ev_count++];
                ev->kind = PDM_DECODE_KVEV_STORED;
                ev->tier = pass ? 1 : 2;
                memcpy(ev->key, e->keys[k], 32);
            }
        }
}

/* Keys e's whole blocks with the router's parameters (none without them). */
static void pdm__pool_key(pdm_decode_node_t *n, pdm__pooled_t *e)
{
    free(e->keys);
    e->keys = NULL;
    e->n_keys = 0;
    if (!n->has_keys) return;
    const int bt = n->kp.block_tokens, max = e->n / bt;
    if (max < 1 || !(e->keys = malloc(sizeof(uint8_t[32]) * (size_t)max))) return;
    e->n_keys = pdm_prefix_block_keys(&n->kp, e->tokens, (uint32_t)e->n, e->keys, max);
}

void pdm_decode_node_set_prefix_keys(pdm_decode_node_t *n, const pdm_prefix_key_params_t *kp)
{
    n->has_keys = 0;
    if (kp && kp->block_tokens > 0 && kp->model && strlen(kp->model) < sizeof(n->kp_model)) {
        n->kp = *kp;
        snprintf(n->kp_model, sizeof(n->kp_model), "%s", kp->model);
        n->kp.model = n->kp_model;
        n->has_keys = 1;
    }
    for (int i = 0; i < n->pool_cap; i++)
        if (pdm__used(&n->pool[i])) pdm__pool_key(n, &n->pool[i]);
    n->pool_st.blocks = pdm__pool_blocks(n);
    if (n->ev) pdm__kvev_snapshot(n);
}

void pdm_decode_node_kv_resync(pdm_decode_node_t *n)
{
    if (n->ev && n->has_keys) pdm__kvev_snapshot(n);
}

int pdm_decode_node_kv_events(pdm_decode_node_t *n, pdm_decode_kv_event_t *out, int max,
                              int *reset)
{
    *reset = 0;
    if (!n->ev || (!n->ev_count && !n->ev_reset)) return 0;
    *reset = n->ev_reset;
    n->ev_reset = 0;
    int k = 0;
    for (; k < max && n->ev_count; k++, n->ev_count--) {
        out[k] = n->ev[n->ev_head];
        n->ev_head = (n->ev_head + 1) % PDM_DECODE_KVEV_QUEUE;
    }
    return k;
}

/* The checksum of each head's K and V rows [0, rows) of a pooled cache (f16/f32, never
 * windowed), seeded with rows. */
static void pdm__pool_checksums(const pdm_kv_cache_t *c, int32_t rows, uint64_t *ck)
{
    const size_t bytes = pdm_dtype_row_bytes(c->dtype, c->head_dim) * (size_t)rows;
    for (uint32_t i = 0; i < c->n_layers * c->n_kv_heads; i++)
        ck[i] = pdm_kvt_block_checksum((uint64_t)rows, c->k[i], c->v[i], bytes);
}

/* Drops a pooled sequence; its block keys that no other pooled sequence (nor `keep`, about
 * to be pooled) holds are evicted. */
static void pdm__pool_drop_keep(pdm_decode_node_t *n, pdm__pooled_t *e, const pdm__pooled_t *keep)
{
    for (int k = 0; e->keys && k < e->n_keys; k++)
        if (!pdm__pool_holds(n, e, keep, e->keys[k]))
            pdm__kvev_push(n, PDM_DECODE_KVEV_EVICTED, e->keys[k]);
    if (e->cache) {
        n->pool_slots -= e->cache->capacity;
        n->pool_st.entries--;
        n->pool_st.bytes -= pdm_kv_cache_bytes(e->cache);
        pdm_kv_cache_destroy(e->cache);
    } else {
        n->pool_file_slots -= e->n;
        n->pool_st.file_bytes -= e->file_bytes;
        pdm_kvtier_free(n->pool_tier, e->file, e->file_bytes);
    }
    free(e->tokens);
    free(e->keys);
    free(e->ck);
    memset(e, 0, sizeof(*e));
}

static void pdm__pool_drop(pdm_decode_node_t *n, pdm__pooled_t *e)
{
    pdm__pool_drop_keep(n, e, n->pool_pending);
}

/* The second tier (SGLang HiCache's host tier, Mooncake's store below GPU memory; here RAM ->
 * file, through the offload code's file tier, decode_node/offload.h): a sequence evicted from
 * RAM moves to the file tier if it fits that tier's token budget (least recently used file
 * entries go first), its rows copied head by head and its checksums kept; its blocks are
 * announced again with tier FILE. 1 when moved (e->cache is then NULL), 0: drop it instead. */
static int pdm__pool_demote(pdm_decode_node_t *n, pdm__pooled_t *e)
{
    if (!n->pool_tier || e->n > n->p.pool_file_tokens) return 0;
    const pdm_kv_cache_t *c = e->cache;
    const size_t row = pdm_dtype_row_bytes(c->dtype, c->head_dim);
    const size_t heads = (size_t)c->n_layers * c->n_kv_heads;
    const size_t bytes = 2 * row * (size_t)e->n * heads;
    pdm__pooled_t *slot = NULL;
    for (;;) { /* room in the tier's budget and a free entry */
        pdm__pooled_t *lru = NULL;
        slot = NULL;
        for (int i = 0; i < n->pool_cap; i++) {
            pdm__pooled_t *f = &n->pool[i];
            if (f->file && (!lru || f->stamp < lru->stamp)) lru = f;
            if (!pdm__used(f) && !slot) slot = f;
        }
        if (n->pool_file_slots + e->n <= n->p.pool_file_tokens && slot) break;
        if (!lru) return 0;
        pdm__pool_drop(n, lru);
        n->pool_st.file_evictions++;
    }
    void *f;
    if (pdm_kvtier_alloc(n->pool_tier, bytes, &f)) return 0;
    for (size_t i = 0; i < heads; i++) {
        memcpy((char *)f + (2 * i) * row * (size_t)e->n, c->k[i], row * (size_t)e->n);
        memcpy((char *)f + (2 * i + 1) * row * (size_t)e->n, c->v[i], row * (size_t)e->n);
    }
    /* the entry stays where it is (only its tier changes); the free one found above is left
     * for the sequence this room is made for */
    n->pool_slots -= c->capacity;
    n->pool_st.entries--;
    n->pool_st.bytes -= pdm_kv_cache_bytes(e->cache);
    pdm_kv_cache_destroy(e->cache);
    e->cache = NULL;
    e->file = f;
    e->file_bytes = bytes;
    n->pool_file_slots += e->n;
    n->pool_st.file_bytes += bytes;
    for (int k = 0; e->keys && k < e->n_keys; k++) { /* still in RAM through another entry? */
        int in_ram = 0;
        for (int i = 0; i < n->pool_cap && !in_ram; i++) {
            const pdm__pooled_t *o = &n->pool[i];
            for (int j = 0; o != e && o->cache && o->keys && j < o->n_keys && !in_ram; j++)
                in_ram = !memcmp(o->keys[j], e->keys[k], 32);
        }
        if (!in_ram) pdm__kvev_push_tier(n, PDM_DECODE_KVEV_STORED, 2, 0, e->keys[k]);
    }
    return 1;
}

/* Evicts least recently used entries until `need` more slots fit beside the reservations
 * (and the pool stays within its size); 1 if they fit then. */
static int pdm__pool_room(pdm_decode_node_t *n, int64_t need, int64_t pool_need)
{
    for (;;) {
        int fits = n->kv_used + n->pool_slots + need <= n->p.kv_budget &&
                   n->pool_slots + pool_need <= n->p.pool_tokens;
        pdm__pooled_t *lru = NULL;
        for (int i = 0; i < n->pool_cap; i++)
            if (n->pool[i].cache && (!lru || n->pool[i].stamp < lru->stamp)) lru = &n->pool[i];
        if (fits || !lru) return fits;
        n->pool_st.evictions++;
        if (!pdm__pool_demote(n, lru)) pdm__pool_drop(n, lru);
    }
}

/* KV for `need` more slots: free, or made free by evicting pooled sequences. */
static int pdm__kv_fits(pdm_decode_node_t *n, int64_t need)
{
    if (n->kv_used + need > n->p.kv_budget) return 0;
    pdm__pool_room(n, need, 0);
    return 1;
}

/* The pooled sequence sharing the longest prefix with tokens[0, n) (at least
 * PDM_DECODE_POOL_MIN tokens, at most n - 1: the last token is always computed, its logits
 * are needed); *m is that length. */
static pdm__pooled_t *pdm__pool_match(pdm_decode_node_t *n, const int32_t *tokens, int32_t len,
                                      int32_t *m)
{
    pdm__pooled_t *best = NULL;
    *m = 0;
    for (int i = 0; i < n->pool_cap; i++) {
        pdm__pooled_t *e = &n->pool[i];
        if (!pdm__used(e)) continue;
        int32_t k = 0, lim = PDM_MIN(e->n, len - 1);
        while (k < lim && e->tokens[k] == tokens[k]) k++;
        if (k >= PDM_DECODE_POOL_MIN && k > *m) best = e, *m = k;
    }
    return best;
}

/* Per-head pointers to a pooled entry's rows, as a cache's k/v arrays ([n_layers *
 * n_kv_heads] each, the caller frees both): into its cache in RAM or its file-tier rows.
 * PDM_ENOMEM leaves both NULL. */
static int pdm__pool_rows(const pdm_decode_node_t *n, const pdm__pooled_t *hit, void ***k,
                          void ***v)
{
    const pdm_model_hparams_t *hp = &n->model->hp;
    const size_t nh = (size_t)hp->n_layers * hp->n_kv_heads;
    void **hk = malloc(sizeof(void *) * nh), **hv = malloc(sizeof(void *) * nh);
    if (!hk || !hv) {
        free(hk);
        free(hv);
        *k = *v = NULL;
        return pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    }
    if (hit->file) {
        const size_t rows = pdm_dtype_row_bytes(n->p.kv_dtype, hp->head_dim) * (size_t)hit->n;
        for (size_t i = 0; i < nh; i++) {
            hk[i] = (char *)hit->file + 2 * i * rows;
            hv[i] = (char *)hit->file + (2 * i + 1) * rows;
        }
    } else {
        memcpy(hk, hit->cache->k, sizeof(void *) * nh);
        memcpy(hv, hit->cache->v, sizeof(void *) * nh);
    }
    *k = hk;
    *v = hv;
    return PDM_OK;
}

/* Verifies a pooled entry's rows (pdm__pool_rows) against its checksums before any reuse
 * (--fault-corrupt-pool flips a byte first). A mismatch drops the entry, counts it corrupt,
 * logs once what happens to the request (`then`) and returns PDM_ECHECKSUM: its rows must not
 * be used. */
static int pdm__pool_verify(pdm_decode_node_t *n, uint64_t id, pdm__pooled_t *hit,
                            void *const *hit_k, void *const *hit_v, const char *then)
{
    const pdm_model_hparams_t *hp = &n->model->hp;
    const size_t nh = (size_t)hp->n_layers * hp->n_kv_heads;
    if (n->p.fault_corrupt_pool) /* tests: what a bad page or a reuse race would do */
        ((uint8_t *)hit_k[0])[0] ^= 0x40;
    uint64_t *ck = malloc(sizeof(uint64_t) * nh);
    if (!ck) return pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    const size_t rows = pdm_dtype_row_bytes(n->p.kv_dtype, hp->head_dim) * (size_t)hit->n;
    for (size_t i = 0; i < nh; i++)
        ck[i] = pdm_kvt_block_checksum((uint64_t)hit->n, hit_k[i], hit_v[i], rows);
    const int bad = memcmp(ck, hit->ck, sizeof(uint64_t) * nh) != 0;
    free(ck);
    if (!bad) return PDM_OK;
    n->pool_st.corrupt++;
    pdm_log_warn("decode node: request %llu: a pooled prefix of %d tokens failed its checksum: "
                 "dropped, %s", (unsigned long long)id, hit->n, then);
    pdm__pool_drop(n, hit);
    return pdm_error_set(PDM_ECHECKSUM, "decode node: request %llu: the pooled prefix failed "
                         "its checksum", (unsigned long long)id);
}

/* A sequence that ended normally: its KV (prompt and the generated tokens fed back) joins the
 * pool, replacing pooled sequences it extends (a chat's earlier turns). */
static void pdm__pool_put(pdm_decode_node_t *n, pdm__seq_t *s)
{
    pdm_kv_cache_t *c = s->cache;
    if (n->p.pool_tokens <= 0 || !s->prompt || s->beam_width || s->off || !c || c->windowed ||
        c->dtype == PDM_DT_I8 || c->pos0 != 0 || c->n_tokens < PDM_DECODE_POOL_MIN ||
        c->n_tokens > s->n_prompt + s->n_tokens)
        return;
    const int32_t len = c->n_tokens;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)len);
    if (!tok) return;
    memcpy(tok, s->prompt, sizeof(int32_t) * (size_t)s->n_prompt);
    memcpy(tok + s->n_prompt, s->tokens, sizeof(int32_t) * (size_t)(len - s->n_prompt));
    uint64_t *ck = malloc(sizeof(uint64_t) * c->n_layers * c->n_kv_heads);
    if (!ck) {
        free(tok);
        return;
    }
    pdm__pool_checksums(c, len, ck);
    /* the new entry, keyed before the ones it supersedes go (their shared blocks stay) */
    pdm__pooled_t fresh = {.tokens = tok, .n = len, .cache = c, .ck = ck};
    pdm__pool_key(n, &fresh);
    /* which of its blocks the pool (and so the router's index) holds already */
    uint8_t *held = fresh.n_keys ? calloc((size_t)fresh.n_keys, 1) : NULL;
    for (int k = 0; held && k < fresh.n_keys; k++)
        held[k] = (uint8_t)pdm__pool_holds_tier(n, fresh.keys[k]);
    for (int i = 0; i < n->pool_cap; i++) { /* superseded: a prefix of this one */
        pdm__pooled_t *e = &n->pool[i];
        if (pdm__used(e) && e->n <= len && !memcmp(e->tokens, tok, sizeof(int32_t) * (size_t)e->n))
            pdm__pool_drop_keep(n, e, &fresh);
    }
    n->pool_pending = &fresh;
    /* its slots stop counting as reserved and start counting as pooled */
    n->kv_used -= s->kv_slots;
    s->kv_slots = 0;
    pdm__pooled_t *slot = NULL;
    if (pdm__pool_room(n, c->capacity, c->capacity))
        for (int i = 0; i < n->pool_cap && !slot; i++)
            if (!pdm__used(&n->pool[i])) slot = &n->pool[i];
    n->pool_pending = NULL;
    if (!slot) { /* blocks of superseded entries kept for it are gone now */
        for (int k = 0; held && k < fresh.n_keys; k++)
            if (held[k] && !pdm__pool_holds(n, NULL, NULL, fresh.keys[k]))
                pdm__kvev_push(n, PDM_DECODE_KVEV_EVICTED, fresh.keys[k]);
        free(held);
        free(fresh.keys);
        free(tok);
        free(ck);
        return;
    }
    if (fresh.n_keys && !held) { /* no memory to tell: the pool is keyed anew (snapshot) */
        fresh.stamp = ++n->pool_stamp;
        *slot = fresh;
        n->pool_st.blocks = pdm__pool_blocks(n);
        if (n->ev && n->has_keys) pdm__kvev_snapshot(n);
    } else {
        for (int k = 0; k < fresh.n_keys; k++) /* new, or back in RAM from the file tier */
            if (held[k] < 2)
                pdm__kvev_push_tier(n, PDM_DECODE_KVEV_STORED, 1, !held[k], fresh.keys[k]);
    }
    free(held);
    fresh.stamp = ++n->pool_stamp;
    *slot = fresh;
    n->pool_slots += c->capacity;
    n->pool_st.entries++;
    n->pool_st.bytes += pdm_kv_cache_bytes(c);
    s->cache = NULL; /* the pool owns it now */
}

void pdm_decode_node_pool_stats(const pdm_decode_node_t *n, pdm_decode_pool_stats_t *st)
{
    *st = n->pool_st;
    st->slots = n->pool_slots;
    st->file_tokens = n->pool_file_slots;
}

/* Throws away what came of the dead streams (pdm__dead_stream_t), entries whose time is up
 * freed. A live sequence whose stream tags look the same (20 bits of the id and 8 of the
 * attempt) keeps its blocks: that dead entry waits. Runs on the decode loop, so it must not
 * wait: pdm_kvt_drain leaves a block still arriving (a rendezvous whose rank died
 * mid-transfer) in flight and finishes or cancels it in a later call (before, it waited up
 * to 2 s per such block, stalling every sequence's next token). */
static void pdm__dead_drain(pdm_decode_node_t *n, double now)
{
    for (int k = 0; k < PDM__DEAD_STREAMS; k++) {
        pdm__dead_stream_t *d = &n->dead[k];
        if (d->until == 0) continue;
        if (now > d->until) {
            d->until = 0;
            continue;
        }
        const uint64_t tag = pdm_kvt_stream_tag(d->id, d->attempt, 0, 0, 0);
        int live = 0;
        for (int i = 0; i < n->p.max_sequences && !live; i++)
            live = n->seqs[i].rx && (pdm_kvt_stream_tag(n->seqs[i].id, n->seqs[i].attempt, 0, 0,
                                                        0) & PDM_KVT_STREAM_MASK_ATTEMPT) ==
                                        (tag & PDM_KVT_STREAM_MASK_ATTEMPT);
        if (!live) pdm_kvt_drain(n->kvt, tag, PDM_KVT_STREAM_MASK_ATTEMPT, NULL, NULL);
    }
}

static void pdm__seq_release(pdm_decode_node_t *n, pdm__seq_t *s)
{
    if (s->rx) { /* its KV was not all in: the ranks may still be sending it */
        n->dead[n->dead_next] = (pdm__dead_stream_t){
            .id = s->id, .attempt = s->attempt, .until = pdm_now() + n->p.kv_timeout + 5};
        n->dead_next = (n->dead_next + 1) % PDM__DEAD_STREAMS;
    }
    pdm_kvt_stream_rx_destroy(s->rx); /* cancels receives before the cache goes away */
    free(s->stage);                   /* (and before the staging goes away) */
    free(s->rx_k);
    free(s->rx_v);
    n->kv_used -= s->kv_slots;
    pdm_beam_kv_destroy(s->beam_kv);
    pdm_beam_search_destroy(s->beam);
    pdm_nsamp_destroy(s->ns);
    for (int i = 0; s->smp && i < s->n_samples; i++) {
        free(s->smp[i].text);
        pdm_gmatch_destroy(s->smp[i].gm);
    }
    free(s->smp);
    if (s->off) pdm_kvoff_destroy(s->off); /* owns s->cache */
    else pdm_kv_cache_destroy(s->cache);
    pdm_sampler_destroy(s->sampler);
    pdm_gmatch_destroy(s->gm);
    pdm_grammar_destroy(s->grammar);
    free(s->tokens);
    free(s->text);
    free(s->local_logits);
    free(s->prompt);
    free(s->hist);
    for (int i = 0; i < s->n_stops; i++) free(s->stops[i]);
    memset(s, 0, sizeof(*s));
}

void pdm_decode_node_destroy(pdm_decode_node_t *n)
{
    if (!n) return;
    for (int i = 0; n->pool && i < n->pool_cap; i++)
        if (pdm__used(&n->pool[i])) pdm__pool_drop(n, &n->pool[i]);
    free(n->pool);
    free(n->ev);
    pdm_kvtier_destroy(n->pool_tier);
    for (int i = 0; n->seqs && i < n->p.max_sequences; i++)
        if (n->seqs[i].state != SEQ_FREE) pdm__seq_release(n, &n->seqs[i]);
    free(n->seqs);
    free(n->logits);
    pdm_vocab_trie_destroy(n->trie);
    pdm_kvoff_engine_destroy(n->offload);
    pdm_act_free(&n->act);
    pdm_model_ctx_destroy(n->ctx);
    free(n);
}

static pdm__seq_t *pdm__find(pdm_decode_node_t *n, uint64_t id)
{
    for (int i = 0; i < n->p.max_sequences; i++)
        if (n->seqs[i].state != SEQ_FREE && n->seqs[i].id == id) return &n->seqs[i];
    return NULL;
}

/* Whether this node runs a beam search of `width` beams (0: none). */
static int pdm__beam_width_check(const pdm_decode_node_t *n, uint64_t id, int width)
{
    if (width < 0 || width > PDM_BEAM_MAX_WIDTH || width > n->p.max_batch)
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu: %d beams (at most %d, and "
                             "at most the batch of %d)", (unsigned long long)id, width,
                             PDM_BEAM_MAX_WIDTH, n->p.max_batch);
    return PDM_OK;
}

/* Staging for a windowed cache's prompt stream: rx_k/rx_v point at the cache's arrays for
 * full layers and at n_prompt-row staging arrays for windowed ones. */
static int pdm__stage_alloc(pdm__seq_t *s, int32_t n_prompt)
{
    const pdm_kv_cache_t *c = s->cache;
    const size_t n_arrays = (size_t)c->n_layers * c->n_kv_heads;
    const size_t rows = (size_t)n_prompt * pdm_dtype_row_bytes(c->dtype, c->head_dim);
    size_t n_win = 0;
    for (uint32_t l = 0; l < c->n_layers; l++) n_win += c->windowed[l];
    s->rx_k = malloc(sizeof(void *) * n_arrays);
    s->rx_v = malloc(sizeof(void *) * n_arrays);
    s->stage = malloc(2 * rows * n_win * c->n_kv_heads);
    if (!s->rx_k || !s->rx_v || !s->stage)
        return pdm_error_set(PDM_ENOMEM, "decode node: no memory to stage %d prompt tokens",
                             n_prompt);
    char *at = s->stage;
    for (uint32_t l = 0; l < c->n_layers; l++)
        for (uint32_t h = 0; h < c->n_kv_heads; h++) {
            const size_t i = (size_t)l * c->n_kv_heads + h;
            if (!c->windowed[l]) {
                s->rx_k[i] = c->k[i];
                s->rx_v[i] = c->v[i];
                continue;
            }
            s->rx_k[i] = at;
            s->rx_v[i] = at + rows;
            at += 2 * rows;
        }
    return PDM_OK;
}

int pdm_decode_node_reserve(pdm_decode_node_t *n, const pdm_decode_reserve_t *r)
{
    const pdm_model_hparams_t *hp = &n->model->hp;
    if (r->n_prompt < 1 || r->max_new < 1 || r->n_ranges < 1 ||
        (int64_t)r->n_prompt + r->max_new > (int64_t)hp->n_ctx_train)
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu: %d prompt + %d new tokens "
                             "(the model's context is %u)", (unsigned long long)r->id,
                             r->n_prompt, r->max_new, hp->n_ctx_train);
    if (pdm__find(n, r->id))
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu is already held",
                             (unsigned long long)r->id);
    /* Beam search: the prompt once, response segments for every beam (eq. 3). */
    /* n samples (nsamp.h) take the KV of a beam search of width n (eq. 3 of beam.h) */
    if (r->samples < 0 || r->samples > PDM_NSAMP_MAX || (r->samples > 0 && r->beams > 0))
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu: %d samples (1..%d, not "
                             "with beam search)", (unsigned long long)r->id, r->samples,
                             PDM_NSAMP_MAX);
    const int width = r->samples > 0 ? r->samples
                      : r->beams < 0 ? 0 : r->beams ? r->beams : n->p.beam.width;
    int st = pdm__beam_width_check(n, r->id, width);
    if (st) return st;
    /* Windowed layers (decode.h): sampled sequences on the resident cache only. */
    pdm_kvwin_plan_t wp;
    st = pdm_kvwin_plan(n->model, n->p.kv_dtype, width || n->offload ? 0 : n->p.kv_window,
                        r->n_prompt, r->max_new, &wp);
    if (st) return st;
    const int64_t need = width ? pdm_beam_kv_slots(width, r->n_prompt, r->max_new)
                               : wp.slots + wp.stage_slots;
    /* Delta transfer: the prefix comes from the pool, found before making room (which may
     * evict it; most recently used, it goes last). */
    pdm__pooled_t *hit = NULL;
    if (r->pool_prefix) {
        if (r->pool_prefix < 0 || r->pool_prefix >= r->n_prompt || !r->tokens)
            return pdm_error_set(PDM_EINVAL, "decode node: request %llu: a pooled prefix of %d "
                                 "tokens (the prompt has %d%s)", (unsigned long long)r->id,
                                 r->pool_prefix, r->n_prompt, r->tokens ? "" : ", not given");
        if (width || n->offload || n->p.kv_dtype == PDM_DT_I8 || n->p.pool_tokens <= 0)
            return pdm_error_set(PDM_EUNSUPPORTED, "decode node: request %llu: no pooled prefix "
                                 "for a beam search, samples, head-wise offload, q8 KV or "
                                 "without a pool", (unsigned long long)r->id);
        int32_t m = 0;
        n->pool_st.lookups++;
        hit = pdm__pool_match(n, r->tokens, r->n_prompt, &m);
        if (!hit || m < r->pool_prefix)
            return pdm_error_set(PDM_ENOTFOUND, "decode node: request %llu: the pool holds %d of "
                                 "the %d prefix tokens asked for (evicted)",
                                 (unsigned long long)r->id, m, r->pool_prefix);
        hit->stamp = ++n->pool_stamp;
    }
    if (!pdm__kv_fits(n, need))
        return pdm_error_set(PDM_EOVERFLOW, "decode node full: request %llu needs %lld KV slots, "
                             "%lld of %lld are free", (unsigned long long)r->id, (long long)need,
                             (long long)(n->p.kv_budget - n->kv_used), (long long)n->p.kv_budget);
    pdm__seq_t *s = NULL;
    for (int i = 0; i < n->p.max_sequences && !s; i++)
        if (n->seqs[i].state == SEQ_FREE) s = &n->seqs[i];
    if (!s)
        return pdm_error_set(PDM_EOVERFLOW, "decode node full: %d sequences held",
                             n->p.max_sequences);
    if (hit && !pdm__used(hit))
        return pdm_error_set(PDM_ENOTFOUND, "decode node: request %llu: the pooled prefix was "
                             "evicted to make room", (unsigned long long)r->id);
    void **hit_k = NULL, **hit_v = NULL;
    int st_pool = hit ? pdm__pool_rows(n, hit, &hit_k, &hit_v) : PDM_OK;
    if (!st_pool && hit)
        st_pool = pdm__pool_verify(n, r->id, hit, hit_k, hit_v,
                                   "the task is refused (streamed in full)");
    if (st_pool) {
        free(hit_k);
        free(hit_v);
        return st_pool;
    }
    /* The plan: one block per (layer, kv head, range). */
    const size_t n_blocks = (size_t)hp->n_layers * hp->n_kv_heads * (size_t)r->n_ranges;
    pdm_kvt_stream_block_t *blocks = malloc(sizeof(*blocks) * n_blocks);
    if (!blocks) {
        free(hit_k);
        free(hit_v);
        return pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    }
    size_t nb = 0;
    for (uint32_t l = 0; l < hp->n_layers; l++)
        for (uint32_t h = 0; h < hp->n_kv_heads; h++)
            for (int i = 0; i < r->n_ranges; i++) {
                if (r->ranges[i].len == 0) continue;
                blocks[nb++] = (pdm_kvt_stream_block_t){
                    .peer = r->ranges[i].peer, .layer = l, .head = h,
                    .chunk = (uint32_t)r->ranges[i].chunk, .token_start = r->ranges[i].start,
                    .n_tokens = r->ranges[i].len};
            }
    /* Head-wise offload: receives land in each head's home tier. Beam searches keep their
     * (shared, prompt-sized) cache resident. */
    if (n->offload && !width) {
        st = pdm_kvoff_create(n->offload, hp, (int32_t)need, n->p.kv_dtype, &s->off);
        if (!st) s->cache = pdm_kvoff_cache(s->off);
    } else if (width) {
        st = pdm_kv_cache_create(hp, r->n_prompt, n->p.kv_dtype, &s->cache);
    } else {
        const pdm_kv_cache_params_t cp = {
            .capacity = r->n_prompt + r->max_new, .dtype = n->p.kv_dtype, .model = n->model,
            .window_reserve = n->p.kv_window};
        st = pdm_kv_cache_create_params(hp, &cp, &s->cache);
        if (!st && wp.stage_slots) st = pdm__stage_alloc(s, r->n_prompt);
    }
    s->tokens = malloc(sizeof(int32_t) * (size_t)r->max_new);
    s->text = malloc(PDM__TEXT_CAP);
    if (!st && (!s->tokens || !s->text))
        st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    if (!st && r->tokens && n->p.pool_tokens > 0 && !width) {
        if (!(s->prompt = malloc(sizeof(int32_t) * (size_t)r->n_prompt)))
            st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
        else
            memcpy(s->prompt, r->tokens, sizeof(int32_t) * (size_t)r->n_prompt);
    }
    /* The pooled prefix's rows where the stream would have put them (a windowed layer's
     * staging included: the window is filled from it when the rest has arrived). */
    if (!st && hit) {
        void *const *dk = s->rx_k ? s->rx_k : s->cache->k, *const *dv = s->rx_v ? s->rx_v
                                                                                 : s->cache->v;
        const size_t rows = pdm_dtype_row_bytes(n->p.kv_dtype, hp->head_dim) *
                            (size_t)r->pool_prefix;
        for (size_t i = 0; i < (size_t)hp->n_layers * hp->n_kv_heads; i++) {
            memcpy(dk[i], hit_k[i], rows);
            memcpy(dv[i], hit_v[i], rows);
        }
        s->cached = r->pool_prefix;
        n->pool_st.hits++;
        n->pool_st.reused_tokens += (uint64_t)r->pool_prefix;
        if (hit->file) n->pool_st.file_hits++;
        hit->stamp = ++n->pool_stamp;
    }
    free(hit_k);
    free(hit_v);
    if (!st) {
        s->kv_slots = need;
        s->stage_slots = width ? 0 : wp.stage_slots;
        n->kv_used += need;
        pdm_kvt_stream_rx_params_t rp = {
            .request_id = r->id, .attempt = r->attempt, .n_layers = hp->n_layers,
            .n_kv_heads = hp->n_kv_heads, .dtype = (uint16_t)n->p.kv_dtype,
            .row_bytes = pdm_dtype_row_bytes(n->p.kv_dtype, hp->head_dim),
            .n_tokens = r->n_prompt, .k = s->rx_k ? s->rx_k : s->cache->k,
            .v = s->rx_v ? s->rx_v : s->cache->v,
            /* q8: the blocks' headers carry each head's scales, fixed at prefill; response
             * rows are appended with them (no re-quantization) */
            .scales = n->p.kv_dtype == PDM_DT_I8 ? s->cache->scale : NULL, .blocks = blocks,
            .n_blocks = (int)nb, .key = r->kv_key, .token_from = r->pool_prefix};
        st = pdm_kvt_stream_rx_start(n->kvt, &rp, &s->rx);
    }
    free(blocks);
    if (st) {
        pdm__seq_release(n, s);
        return st;
    }
    s->state = SEQ_RESERVED;
    s->id = r->id;
    s->attempt = r->attempt;
    s->n_prompt = r->n_prompt;
    s->max_new = r->max_new;
    s->beam_width = width;
    s->n_samples = r->samples > 0 ? r->samples : 0;
    s->t_start = pdm_now();
    return PDM_OK;
}

/* The beam-search part of start: the search and the segmented cache over the prompt. */
static int pdm__beam_start(pdm_decode_node_t *n, pdm__seq_t *s, const pdm_decode_start_t *st_)
{
    pdm_beam_params_t bp = st_->beam.n_best ? st_->beam : n->p.beam;
    if (bp.width && bp.width != s->beam_width)
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu was reserved for %d beams, "
                             "started with %d", (unsigned long long)s->id, s->beam_width,
                             bp.width);
    bp.width = s->beam_width;
    if (bp.n_best > bp.width) bp.n_best = bp.width;
    int st = pdm_beam_params_check(&bp);
    if (st) return st;
    if (st_->prompt_last < 0 || (uint32_t)st_->prompt_last >= n->model->hp.n_vocab)
        return pdm_error_set(PDM_EINVAL, "decode node: beam search needs the last prompt token "
                             "(prompt_last)");
    for (int i = 0; i < st_->n_stops; i++)
        if (st_->stops[i] && st_->stops[i][0])
            return pdm_error_set(PDM_EINVAL, "decode node: stop strings are not supported with "
                                 "beam search");
    /* max_new - 1 response steps: the last generated token is never fed back. */
    st = pdm_beam_kv_create(&n->model->hp, s->cache, s->n_prompt, bp.width,
                            PDM_MAX(1, s->max_new - 1), &s->beam_kv);
    if (!st)
        st = pdm_beam_search_create(&bp, (int32_t)n->model->hp.n_vocab, s->max_new, n->eog,
                                    n->n_eog, &s->beam);
    if (st) {
        pdm_beam_kv_destroy(s->beam_kv);
        s->beam_kv = NULL;
        return st;
    }
    pdm_beam_search_prime(s->beam, st_->prompt_last);
    s->beam_p = bp;
    s->deadline = st_->deadline;
    s->state = SEQ_STARTED;
    s->t_start = pdm_now();
    return PDM_OK;
}

/* A local prefill that also scores the prompt (r->prompt_lp): the prompt in blocks of
 * PDM__SCORE_ROWS rows with every row's logits, each row scoring the next token as a prefill
 * rank does (pdm_sampler_score), the last row's logits kept for the first token. */
#define PDM__SCORE_ROWS 32
static int pdm__prefill_scored(pdm_decode_node_t *n, pdm__seq_t *s, const pdm_decode_local_t *r)
{
    const size_t n_vocab = n->model->hp.n_vocab;
    float *rows = malloc(sizeof(float) * PDM__SCORE_ROWS * n_vocab);
    if (!rows) return pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    int st = PDM_OK;
    for (int32_t c0 = 0; c0 < r->n_tokens && !st; c0 += PDM__SCORE_ROWS) {
        const int cn = (int)PDM_MIN(PDM__SCORE_ROWS, r->n_tokens - c0);
        st = pdm_model_prefill_logits(n->ctx, s->cache, r->tokens + c0, cn, 0, rows);
        for (int i = 0; !st && i < cn; i++) {
            const int32_t p = c0 + i + 1; /* the position row c0 + i predicts */
            if (p < r->n_tokens)
                pdm_sampler_score(rows + (size_t)i * n_vocab, (int32_t)n_vocab, r->tokens[p],
                                  r->prompt_top, &r->prompt_lp[p]);
        }
        if (!st && c0 + cn == r->n_tokens)
            memcpy(s->local_logits, rows + (size_t)(cn - 1) * n_vocab, sizeof(float) * n_vocab);
    }
    free(rows);
    return st;
}

int pdm_decode_node_reserve_local(pdm_decode_node_t *n, const pdm_decode_local_t *r)
{
    const uint64_t id = r->id;
    const int32_t *tokens = r->tokens;
    const int32_t n_tokens = r->n_tokens, max_new = r->max_new;
    const int beams = r->beams;
    const pdm_model_hparams_t *hp = &n->model->hp;
    if (n_tokens < 1 || max_new < 1 || (int64_t)n_tokens + max_new > (int64_t)hp->n_ctx_train)
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu: %d prompt + %d new tokens "
                             "(the model's context is %u)", (unsigned long long)id, n_tokens,
                             max_new, hp->n_ctx_train);
    if (r->n_generated < 0 || r->n_generated >= n_tokens)
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu: %d generated tokens in a "
                             "prompt of %d", (unsigned long long)id, r->n_generated, n_tokens);
    for (int32_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= hp->n_vocab)
            return pdm_error_set(PDM_ERANGE, "decode node: prompt token %d is outside the "
                                 "vocabulary", tokens[i]);
    if (pdm__find(n, id))
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu is already held",
                             (unsigned long long)id);
    if (r->samples < 0 || r->samples > PDM_NSAMP_MAX ||
        (r->samples > 0 && (beams > 0 || r->prompt_lp)) || (r->samples > 1 && r->n_generated))
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu: %d samples (1..%d; more "
                             "than one for a new prompt only; no beam search, no prompt "
                             "log-probabilities)", (unsigned long long)id, r->samples,
                             PDM_NSAMP_MAX);
    /* n samples over the segmented cache; one sample resuming a migrated choice keeps its
     * delivered tokens out of the prompt: they are replayed as steps of that cache (start) */
    const int nsamp = r->samples > 0;
    const int32_t resumed = nsamp ? r->n_generated : 0;
    const int width = nsamp ? r->samples : beams > 0 ? beams : 0;
    int st = pdm__beam_width_check(n, id, width);
    if (st) return st;
    /* Beam search: the prompt once, response segments for every beam (eq. 3, beam.h). */
    /* Windowed layers (decode.h): not for beams, nor a q8 prompt (its scales come from every
     * layer's whole prompt before any row is stored). */
    const double r_win = width || n->p.kv_dtype == PDM_DT_I8 ? 0 : n->p.kv_window;
    pdm_kvwin_plan_t wp;
    st = pdm_kvwin_plan(n->model, n->p.kv_dtype, r_win, n_tokens, max_new, &wp);
    if (st) return st;
    const int64_t need = width ? pdm_beam_kv_slots(width, n_tokens - resumed, resumed + max_new)
                               : wp.slots;
    /* The prefix pool's longest match, found before making room (which may evict it). */
    int32_t m = 0;
    /* (a replayed migration recomputes the delivered tokens as they were first computed) */
    if (r->prompt_lp && (r->n_generated || width))
        return pdm_error_set(PDM_EINVAL, "decode node: request %llu: prompt log-probabilities "
                             "of a new prompt only, without beam search", (unsigned long long)id);
    pdm__pooled_t *hit = width || n->p.kv_dtype == PDM_DT_I8 || r->replay || r->prompt_lp
                             ? NULL : pdm__pool_match(n, tokens, n_tokens, &m);
    if (hit) hit->stamp = ++n->pool_stamp; /* most recently used: evicted last */
    if (!pdm__kv_fits(n, need))
        return pdm_error_set(PDM_EOVERFLOW, "decode node full: request %llu needs %lld KV slots, "
                             "%lld of %lld are free", (unsigned long long)id, (long long)need,
                             (long long)(n->p.kv_budget - n->kv_used), (long long)n->p.kv_budget);
    if (hit && !pdm__used(hit)) hit = NULL; /* evicted after all (or moved to the file tier) */
    if (!width && n->p.kv_dtype != PDM_DT_I8 && !r->replay && !r->prompt_lp)
        n->pool_st.lookups++;
    void **hit_k = NULL, **hit_v = NULL;
    if (hit && pdm__pool_rows(n, hit, &hit_k, &hit_v)) hit = NULL;
    if (hit && pdm__pool_verify(n, id, hit, hit_k, hit_v, "the prompt is prefilled in full")) {
        free(hit_k);
        free(hit_v);
        hit_k = hit_v = NULL;
        hit = NULL;
        m = 0;
    }
    pdm__seq_t *s = NULL;
    for (int i = 0; i < n->p.max_sequences && !s; i++)
        if (n->seqs[i].state == SEQ_FREE) s = &n->seqs[i];
    if (!s) {
        free(hit_k);
        free(hit_v);
        return pdm_error_set(PDM_EOVERFLOW, "decode node full: %d sequences held",
                             n->p.max_sequences);
    }
    const pdm_kv_cache_params_t cp = {.capacity = width ? n_tokens - resumed : n_tokens + max_new,
                                      .dtype = n->p.kv_dtype, .model = n->model,
                                      .window_reserve = r_win};
    st = pdm_kv_cache_create_params(hp, &cp, &s->cache);
    if (!st) {
        s->kv_slots = need;
        n->kv_used += need;
        s->tokens = malloc(sizeof(int32_t) * (size_t)max_new);
        s->text = malloc(PDM__TEXT_CAP);
        s->local_logits = malloc(sizeof(float) * hp->n_vocab);
        if (!s->tokens || !s->text || !s->local_logits)
            st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    }
    if (!st && n->p.pool_tokens > 0 && !width) {
        if (!(s->prompt = malloc(sizeof(int32_t) * (size_t)n_tokens)))
            st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
        else
            memcpy(s->prompt, tokens, sizeof(int32_t) * (size_t)n_tokens);
    }
    /* A pooled prefix: its rows are copied (the pooled sequence stays for others). */
    if (!st && hit) {
        const size_t row = pdm_dtype_row_bytes(s->cache->dtype, hp->head_dim);
        for (uint32_t i = 0; i < hp->n_layers * hp->n_kv_heads; i++) {
            if (s->cache->windowed && s->cache->windowed[i / hp->n_kv_heads]) continue;
            memcpy(s->cache->k[i], hit_k[i], row * (size_t)m);
            memcpy(s->cache->v[i], hit_v[i], row * (size_t)m);
        }
        /* windowed layers: the last S - 1 of the m rows (pooled caches are never windowed) */
        pdm_kv_cache_window_fill(s->cache, hit_k, hit_v, m);
        s->cache->n_tokens = m;
        s->cached = m;
        n->pool_st.hits++;
        n->pool_st.reused_tokens += (uint64_t)m;
        if (hit->file) n->pool_st.file_hits++; /* loaded back: pooled in RAM when it ends */
        hit->stamp = ++n->pool_stamp;
    }
    free(hit_k);
    free(hit_v);
    /* Conditional disaggregation / migration: this node computes the prompt's KV itself. */
    const int32_t replay = r->replay || resumed ? r->n_generated : 0; /* as first computed */
    const int32_t upto = n_tokens - replay; /* prefilled in one batch: [cached, upto) */
    if (!st && r->prompt_lp)
        st = pdm__prefill_scored(n, s, r);
    else if (!st && upto > s->cached)
        st = pdm_model_prefill(n->ctx, s->cache, tokens + s->cached, upto - s->cached,
                               s->local_logits);
    for (int32_t i = PDM_MAX(upto, s->cached); !st && !resumed && i < n_tokens; i++)
        st = pdm_model_decode(n->ctx, s->cache, tokens[i], s->local_logits);
    if (!st && r->n_generated) {
        s->n_done = r->n_generated;
        s->hist = malloc(sizeof(int32_t) * ((size_t)s->n_done + (size_t)max_new));
        if (!s->hist) st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
        else memcpy(s->hist, tokens + n_tokens - s->n_done, sizeof(int32_t) * (size_t)s->n_done);
    }
    if (st) {
        pdm__seq_release(n, s);
        return st;
    }
    s->state = SEQ_RESERVED;
    s->local = 1;
    s->beam_width = width;
    s->n_samples = nsamp ? r->samples : 0;
    s->id = id;
    s->attempt = r->attempt;
    s->n_prompt = n_tokens - resumed;
    s->max_new = max_new;
    s->t_start = pdm_now();
    return PDM_OK;
}

/* Structured output: compiles the schema and sets the matcher on the sampler. After a
 * migration the matcher is rebuilt by feeding it the n_done tokens already delivered (s->hist),
 * so the continuation is constrained from where the first node left off. */
static int pdm__grammar_start(pdm_decode_node_t *n, pdm__seq_t *s, const char *schema)
{
    if (!n->model->tokenizer)
        return pdm_error_set(PDM_EUNSUPPORTED, "decode node: json_schema needs the model's "
                             "tokenizer");
    if (!n->trie && !(n->trie = pdm_vocab_trie_create(n->model->tokenizer))) return PDM_ENOMEM;
    int st = pdm_grammar_compile(schema, strlen(schema), &s->grammar);
    if (st) return st;
    if (!(s->gm = pdm_gmatch_create(s->grammar, n->trie))) return PDM_ENOMEM;
    for (int i = 0; i < s->n_done; i++)
        if (!pdm_gmatch_accept_token(s->gm, s->hist[i]))
            return pdm_error_set(PDM_EINVAL, "decode node: delivered token %d (step %d) does "
                                 "not fit the json_schema", s->hist[i], i);
    pdm_sampler_set_grammar(s->sampler, s->gm);
    return PDM_OK;
}

/* The n-samples part of start (OpenAI's n, nsamp.h): the segmented response KV of width n
 * over the prompt, the samples (sample i seeded with pdm_nsamp_seed(seed, i)), each with its
 * own text and structured-output matcher. The first tokens are drawn by the node from the last
 * prompt token's logits: the local prefill's, the prefill side's (first_logits), or else a
 * priming step's that recomputes it (prompt_last); the rank's own first token is not used. */
static int pdm__nsamp_start(pdm_decode_node_t *n, pdm__seq_t *s, const pdm_decode_start_t *st_)
{
    const uint32_t n_vocab = n->model->hp.n_vocab;
    int st = pdm_sampler_params_check(&st_->sp);
    if (st) return st;
    if (!s->local && !st_->first_logits &&
        (st_->prompt_last < 0 || (uint32_t)st_->prompt_last >= n_vocab))
        return pdm_error_set(PDM_EINVAL, "decode node: %d samples of a streamed prompt need its "
                             "last token (prompt_last) or its logits", s->n_samples);
    if (!s->local && st_->first_logits) { /* drawn from the prefill side's logits */
        if (!s->local_logits && !(s->local_logits = malloc(sizeof(float) * n_vocab)))
            return pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
        memcpy(s->local_logits, st_->first_logits, sizeof(float) * n_vocab);
        s->prime_given = 1;
    }
    for (int i = 0; i < st_->n_stops; i++) {
        if (!st_->stops[i] || !st_->stops[i][0]) continue;
        if (!(s->stops[s->n_stops] = strdup(st_->stops[i])))
            return pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
        s->n_stops++;
    }
    /* max_new - 1 response steps: a sample's last token is never fed back. */
    /* a resumed sample's n_done delivered tokens count among its tokens (replayed first) */
    const int32_t total = s->n_done + s->max_new;
    st = pdm_beam_kv_create(&n->model->hp, s->cache, s->n_prompt, s->n_samples,
                            PDM_MAX(1, total - 1), &s->beam_kv);
    if (!st)
        st = pdm_nsamp_create(&st_->sp, s->n_samples, (int32_t)n_vocab, total, s->beam_kv,
                              st_->prompt_last >= 0 ? st_->prompt_last : 0, &s->ns);
    if (!st && !(s->smp = calloc((size_t)s->n_samples, sizeof(*s->smp))))
        st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    for (int i = 0; !st && i < s->n_samples; i++) {
        pdm_detok_init(&s->smp[i].detok, 0);
        if (!(s->smp[i].text = malloc(PDM__TEXT_CAP)))
            st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
        else
            s->smp[i].text[0] = 0;
    }
    if (!st && st_->sp.json_schema) { /* one grammar, a matcher per sample */
        if (!n->model->tokenizer)
            st = pdm_error_set(PDM_EUNSUPPORTED, "decode node: json_schema needs the model's "
                               "tokenizer");
        if (!st && !n->trie && !(n->trie = pdm_vocab_trie_create(n->model->tokenizer)))
            st = PDM_ENOMEM;
        if (!st)
            st = pdm_grammar_compile(st_->sp.json_schema, strlen(st_->sp.json_schema),
                                     &s->grammar);
        for (int i = 0; !st && i < s->n_samples; i++) {
            if (!(s->smp[i].gm = pdm_gmatch_create(s->grammar, n->trie))) st = PDM_ENOMEM;
            else pdm_sampler_set_grammar(pdm_nsamp_sampler(s->ns, i), s->smp[i].gm);
        }
        for (int k = 0; !st && k < s->n_done; k++) /* the matcher after the delivered tokens */
            if (!pdm_gmatch_accept_token(s->smp[0].gm, s->hist[k]))
                st = pdm_error_set(PDM_EINVAL, "decode node: delivered token %d (step %d) does "
                                   "not fit the json_schema", s->hist[k], k);
    }
    if (st) { /* what start made goes; the reservation stays (released by its owner) */
        pdm_nsamp_destroy(s->ns);
        s->ns = NULL;
        for (int i = 0; s->smp && i < s->n_samples; i++) {
            free(s->smp[i].text);
            pdm_gmatch_destroy(s->smp[i].gm);
        }
        free(s->smp);
        s->smp = NULL;
        pdm_grammar_destroy(s->grammar);
        s->grammar = NULL;
        pdm_beam_kv_destroy(s->beam_kv);
        s->beam_kv = NULL;
        for (int i = 0; i < s->n_stops; i++) free(s->stops[i]);
        s->n_stops = 0;
        return st;
    }
    s->deadline = st_->deadline;
    s->ignore_eos = st_->ignore_eos;
    s->want_lp = st_->sp.logprobs >= 0;
    s->state = SEQ_STARTED;
    s->t_start = pdm_now();
    return PDM_OK;
}

int pdm_decode_node_start(pdm_decode_node_t *n, const pdm_decode_start_t *st_)
{
    pdm__seq_t *s = pdm__find(n, st_->id);
    if (!s) return pdm_error_set(PDM_ENOTFOUND, "decode node: no reservation for request %llu",
                                 (unsigned long long)st_->id);
    if (s->state != SEQ_RESERVED)
        return pdm_error_set(PDM_ESTATE, "decode node: request %llu already started",
                             (unsigned long long)st_->id);
    if (!(s->local && st_->first_token < 0) &&
        (st_->first_token < 0 || (uint32_t)st_->first_token >= n->model->hp.n_vocab))
        return pdm_error_set(PDM_ERANGE, "decode node: first token %d is outside the vocabulary",
                             st_->first_token);
    if (st_->n_stops < 0 || st_->n_stops > PDM__MAX_STOPS)
        return pdm_error_set(PDM_EINVAL, "decode node: at most %d stop strings", PDM__MAX_STOPS);
    if (s->n_samples) return pdm__nsamp_start(n, s, st_);
    if (s->beam_width) return pdm__beam_start(n, s, st_);
    int st = pdm_sampler_params_check(&st_->sp);
    if (!st) st = pdm_sampler_create(&st_->sp, (int32_t)n->model->hp.n_vocab, &s->sampler);
    if (!st && st_->sp.json_schema) st = pdm__grammar_start(n, s, st_->sp.json_schema);
    if (st) return st;
    for (int i = 0; i < st_->n_stops; i++) {
        if (!st_->stops[i] || !st_->stops[i][0]) continue;
        if (!(s->stops[s->n_stops] = strdup(st_->stops[i])))
            return pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
        s->n_stops++;
    }
    pdm_detok_init(&s->detok, 0);
    s->deadline = st_->deadline;
    s->ignore_eos = st_->ignore_eos;
    s->next = st_->first_token;
    s->want_lp = st_->sp.logprobs >= 0;
    memset(&s->first_lp, 0, sizeof(s->first_lp));
    s->first_lp_known = 1;
    if (s->local && st_->first_token < 0)
        s->next = pdm_sampler_sample(s->sampler, s->local_logits, s->hist, s->n_done,
                                     &s->first_lp);
    else if (st_->first_logprob && s->want_lp)
        s->first_lp = *st_->first_logprob;
    else
        s->first_lp_known = 0; /* reported without log-probabilities (the router: missing) */
    s->state = SEQ_STARTED;
    s->t_start = pdm_now();
    return PDM_OK;
}

/* A beam search's DONE: the n-best list (the best one as tokens/text), its texts, and the
 * memory of the segmented cache against eq. (2) and (3). */
static void pdm__beam_done(pdm_decode_node_t *n, pdm__seq_t *s, pdm_decode_event_t *ev,
                           pdm_decode_event_cb cb, void *arg)
{
    pdm_beam_search_finish(s->beam); /* no-op when it ended by itself */
    const pdm_beam_hyp_t *hyps;
    const int n_hyps = pdm_beam_search_results(s->beam, &hyps);
    char *texts[PDM_BEAM_MAX_WIDTH] = {0};
    for (int h = 0; h < n_hyps; h++) {
        size_t len = 0, cap = 256;
        char *t = malloc(cap);
        pdm_detok_t d;
        pdm_detok_init(&d, 0);
        for (int i = 0; t && i < hyps[h].n_tokens; i++) {
            if (pdm_tokenizer_is_eog(n->model->tokenizer, hyps[h].tokens[i])) continue;
            char piece[256];
            int w = pdm_detok_feed(&d, n->model->tokenizer, hyps[h].tokens[i], piece, sizeof(piece));
            if (w <= 0) continue;
            if (len + (size_t)w + 1 > cap) {
                char *bigger = realloc(t, cap = 2 * (len + (size_t)w + 1));
                if (!bigger) {
                    free(t);
                    t = NULL;
                    break;
                }
                t = bigger;
            }
            memcpy(t + len, piece, (size_t)w);
            len += (size_t)w;
        }
        if (t) t[len] = 0;
        texts[h] = t;
    }
    const pdm_beam_kv_t *kv = s->beam_kv;
    const pdm_model_hparams_t *hp = &n->model->hp;
    pdm_beam_report_t rep = {
        .width = s->beam_p.width, .length_penalty = s->beam_p.length_penalty,
        .early_stopping = s->beam_p.early_stopping, .hyps = hyps,
        .texts = (const char *const *)texts, .n_hyps = n_hyps, .n_prompt = s->n_prompt,
        .n_response = kv->n_steps, .prompt_bytes = pdm_kv_cache_bytes(s->cache),
        .response_bytes = kv->bytes,
        .eq2_bytes = pdm_beam_bytes_standard(hp, kv->dtype, kv->width, s->n_prompt, kv->n_steps),
        .eq3_bytes = pdm_beam_bytes_segment(hp, kv->dtype, kv->width, s->n_prompt, kv->n_steps)};
    char *owned[PDM_BEAM_MAX_WIDTH];
    memcpy(owned, texts, sizeof(owned));
    for (int h = 0; h < n_hyps; h++)
        if (!texts[h]) texts[h] = (char *)"";
    if (n_hyps > 0) {
        ev->tokens = hyps[0].tokens;
        ev->n_tokens = hyps[0].n_tokens;
        ev->text = texts[0];
        if (!strcmp(ev->finish, "length") || !strcmp(ev->finish, "eos"))
            ev->finish = hyps[0].eos ? "eos" : "length";
    }
    ev->beam = &rep;
    cb(arg, ev);
    for (int h = 0; h < n_hyps; h++) free(owned[h]);
}

/* Appends a generated token (text included) and decides whether the sequence ends; returns
 * the finish reason or NULL. */
static const char *pdm__append(pdm_decode_node_t *n, pdm__seq_t *s, int32_t tok)
{
    if (s->hist) s->hist[s->n_done + s->n_tokens] = tok;
    if (s->gm && !pdm_gmatch_accept_token(s->gm, tok)) /* only a first token sampled elsewhere
                                                         * without the mask can get here */
        pdm_log_warn("decode node: request %llu: token %d does not fit its json_schema",
                     (unsigned long long)s->id, tok);
    s->tokens[s->n_tokens++] = tok;
    const int eog = pdm_tokenizer_is_eog(n->model->tokenizer, tok);
    if (eog && !s->ignore_eos) return "eos";
    char piece[256];
    /* ignore_eos: generation goes on past it; its text is left out, as without */
    int w = eog ? 0 : pdm_detok_feed(&s->detok, n->model->tokenizer, tok, piece, sizeof(piece));
    if (w > 0 && s->text_len + (size_t)w < PDM__TEXT_CAP) {
        memcpy(s->text + s->text_len, piece, (size_t)w);
        s->text_len += (size_t)w;
        s->text[s->text_len] = 0;
    }
    for (int i = 0; i < s->n_stops; i++) {
        char *hit = strstr(s->text, s->stops[i]);
        if (hit) {
            s->text_len = (size_t)(hit - s->text);
            s->text[s->text_len] = 0;
            return "stop";
        }
    }
    if (s->n_tokens >= s->max_new) return "length";
    return NULL;
}

/* Sample i generated `tok` (its token number `index`): its matcher, text, stop strings and
 * length; returns how it ends with it, or NULL (pdm__append's rule, per sample). */
static const char *pdm__sample_append(pdm_decode_node_t *n, pdm__seq_t *s, int i, int32_t tok,
                                      int index)
{
    pdm__sample_t *x = &s->smp[i];
    if (x->gm && !pdm_gmatch_accept_token(x->gm, tok))
        pdm_log_warn("decode node: request %llu sample %d: token %d does not fit its "
                     "json_schema", (unsigned long long)s->id, i, tok);
    const int eog = pdm_tokenizer_is_eog(n->model->tokenizer, tok);
    if (eog && !s->ignore_eos) return "eos";
    char piece[256];
    int w = eog ? 0 : pdm_detok_feed(&x->detok, n->model->tokenizer, tok, piece, sizeof(piece));
    if (w > 0 && x->text_len + (size_t)w < PDM__TEXT_CAP) {
        memcpy(x->text + x->text_len, piece, (size_t)w);
        x->text_len += (size_t)w;
        x->text[x->text_len] = 0;
    }
    for (int k = 0; k < s->n_stops; k++) {
        char *hit = strstr(x->text, s->stops[k]);
        if (hit) {
            x->text_len = (size_t)(hit - x->text);
            x->text[x->text_len] = 0;
            return "stop";
        }
    }
    return index + 1 >= s->max_new ? "length" : NULL;
}

/* The samples draw from a step's logits (rows in pdm_nsamp_inputs order; priming: the one
 * row, or the local prefill's logits): a TOKEN event per sample, tagged with it and, when the
 * sample ends with it, with how. Then the KV is readied for the next step. Returns the live
 * samples. */
static int pdm__nsamp_draw(pdm_decode_node_t *n, pdm__seq_t *s, const float *logits,
                           int prime_only, pdm_decode_event_cb cb, void *arg)
{
    if (s->forced < s->n_done) { /* a resumed sample: its delivered tokens first, as steps */
        pdm_nsamp_force(s->ns, 0, s->hist[s->forced++]);
        if (prime_only) pdm_beam_kv_commit(s->beam_kv);
        pdm_nsamp_advance(s->ns);
        return pdm_nsamp_live(s->ns);
    }
    pdm_nsamp_token_t out[PDM_NSAMP_MAX];
    const int k = prime_only ? pdm_nsamp_prime(s->ns, logits, out)
                             : pdm_nsamp_sample(s->ns, logits, out);
    for (int j = 0; j < k; j++) {
        const int i = out[j].sample;
        const int index = out[j].index - s->n_done; /* among the tokens this node delivers */
        const char *why = pdm__sample_append(n, s, i, out[j].token, index);
        pdm_decode_event_t ev = {.type = PDM_DECODE_EV_TOKEN, .id = s->id,
                                 .token = out[j].token, .index = index,
                                 .logprob = s->want_lp ? &out[j].lp : NULL, .sample = i,
                                 .sample_finish = why};
        cb(arg, &ev);
        if (why) {
            s->smp[i].finish = why;
            pdm_nsamp_finish(s->ns, i);
        }
    }
    pdm_nsamp_advance(s->ns);
    return pdm_nsamp_live(s->ns);
}

/* The DONE of n samples: each sample's tokens, text and end (`why` for those still running:
 * the deadline or a cancel), sample 0's as the event's own. */
static void pdm__nsamp_done(pdm__seq_t *s, pdm_decode_event_t *ev, const char *why,
                            pdm_decode_event_cb cb, void *arg)
{
    const int32_t *toks[PDM_NSAMP_MAX];
    int nt[PDM_NSAMP_MAX];
    const char *fin[PDM_NSAMP_MAX], *texts[PDM_NSAMP_MAX];
    for (int i = 0; i < s->n_samples; i++) {
        toks[i] = s->ns ? pdm_nsamp_tokens(s->ns, i, &nt[i]) : NULL;
        if (!s->ns) nt[i] = 0;
        if (s->ns && i == 0 && s->n_done) { /* the delivered tokens were replayed, not new */
            const int d = PDM_MIN(s->n_done, nt[0]);
            toks[0] += d;
            nt[0] -= d;
        }
        fin[i] = s->smp && s->smp[i].finish ? s->smp[i].finish : why;
        texts[i] = s->smp && s->smp[i].text ? s->smp[i].text : "";
    }
    ev->n_samples = s->n_samples;
    ev->sample_tokens = toks;
    ev->sample_n_tokens = nt;
    ev->sample_finish_all = fin;
    ev->sample_text = texts;
    ev->tokens = toks[0];
    ev->n_tokens = nt[0];
    ev->text = texts[0];
    cb(arg, ev);
}

static void pdm__finish(pdm_decode_node_t *n, pdm__seq_t *s, const char *why,
                        pdm_decode_event_cb cb, void *arg)
{
    if (!s->text) s->text_len = 0;
    else s->text[s->text_len] = 0;
    pdm_decode_event_t ev = {
        .type = PDM_DECODE_EV_DONE, .id = s->id, .finish = why, .tokens = s->tokens,
        .n_tokens = s->n_tokens, .text = s->text ? s->text : "", .kv_seconds = s->kv_seconds,
        .step_seconds = s->steps ? s->step_total / s->steps : 0, .kv_bytes = s->kv_bytes,
        .cached_tokens = s->cached};
    if (s->cache) pdm_kvwin_cache_bytes(n->model, s->cache, &ev.kv_local_bytes, &ev.kv_global_bytes);
    if (s->beam) {
        pdm__beam_done(n, s, &ev, cb, arg);
        pdm__seq_release(n, s);
        return;
    }
    if (s->n_samples) {
        pdm__nsamp_done(s, &ev, why, cb, arg);
        pdm__seq_release(n, s);
        return;
    }
    cb(arg, &ev);
    if (!strcmp(why, "eos") || !strcmp(why, "length") || !strcmp(why, "stop"))
        pdm__pool_put(n, s);
    pdm__seq_release(n, s);
}

/* kv_error: the prompt's KV failed to arrive or verify (pdm_decode_event_t). */
static void pdm__fail(pdm_decode_node_t *n, pdm__seq_t *s, const char *msg, int kv_error,
                      pdm_decode_event_cb cb, void *arg)
{
    pdm_decode_event_t ev = {.type = PDM_DECODE_EV_ERROR, .id = s->id, .error = msg,
                             .kv_error = kv_error};
    cb(arg, &ev);
    pdm__seq_release(n, s);
}

int pdm_decode_node_cancel(pdm_decode_node_t *n, uint64_t id)
{
    pdm__seq_t *s = pdm__find(n, id);
    if (!s) return pdm_error_set(PDM_ENOTFOUND, "decode node: no request %llu",
                                 (unsigned long long)id);
    s->deadline = -1; /* finished as "cancelled" by the next round */
    return PDM_OK;
}

void pdm_decode_node_usage(const pdm_decode_node_t *n, int *held, int64_t *kv_slots)
{
    int k = 0;
    for (int i = 0; i < n->p.max_sequences; i++) k += n->seqs[i].state != SEQ_FREE;
    *held = k;
    *kv_slots = n->kv_used;
}

int pdm_decode_node_running(const pdm_decode_node_t *n)
{
    int k = 0;
    for (int i = 0; i < n->p.max_sequences; i++) k += n->seqs[i].state == SEQ_RUNNING;
    return k;
}

int pdm_decode_node_run_once(pdm_decode_node_t *n, pdm_decode_event_cb cb, void *arg)
{
    const double now = pdm_now();
    pdm__dead_drain(n, now);
    /* Arrivals, cancellations and deadlines. */
    for (int i = 0; i < n->p.max_sequences; i++) {
        pdm__seq_t *s = &n->seqs[i];
        if (s->state == SEQ_FREE) continue;
        if (s->deadline < 0) {
            pdm__finish(n, s, "cancelled", cb, arg);
            continue;
        }
        if (s->deadline > 0 && now > s->deadline) {
            pdm__finish(n, s, "deadline", cb, arg);
            continue;
        }
        if (s->state == SEQ_RESERVED && now - s->t_start > n->p.kv_timeout) {
            char msg[256];
            snprintf(msg, sizeof(msg), "request %llu: reserved but not started within %.0f s",
                     (unsigned long long)s->id, n->p.kv_timeout);
            pdm__fail(n, s, msg, 0, cb, arg);
            continue;
        }
        if (s->state == SEQ_STARTED && !s->kv_done) {
            int st = s->local ? 1 : pdm_kvt_stream_rx_poll(s->rx);
            if (st < 0) {
                pdm__fail(n, s, pdm_error_last(), 1, cb, arg);
                continue;
            }
            if (st == 0) {
                if (now - s->t_start > n->p.kv_timeout) {
                    char msg[256];
                    snprintf(msg, sizeof(msg), "request %llu: KV did not arrive within %.0f s",
                             (unsigned long long)s->id, n->p.kv_timeout);
                    pdm__fail(n, s, msg, 1, cb, arg);
                }
                continue;
            }
            pdm_kvt_stream_stats_t ss = {0};
            if (s->rx) pdm_kvt_stream_rx_stats(s->rx, &ss);
            s->kv_bytes = ss.bytes;
            s->kv_done = 1;
            s->kv_seconds = pdm_now() - s->t_start;
            pdm_kvt_stream_rx_destroy(s->rx); /* every receive completed: drains leftovers */
            s->rx = NULL;
            if (s->stage) { /* windowed layers keep the last S - 1 prompt rows */
                pdm_kv_cache_window_fill(s->cache, s->rx_k, s->rx_v, s->n_prompt);
                free(s->stage);
                free(s->rx_k);
                free(s->rx_v);
                s->stage = NULL;
                s->rx_k = s->rx_v = NULL;
                n->kv_used -= s->stage_slots;
                s->kv_slots -= s->stage_slots;
                s->stage_slots = 0;
            }
            s->cache->n_tokens = s->n_prompt;
            pdm_kv_cache_fix_scales(s->cache); /* q8: set from the verified headers */
            if (s->beam) { /* the search picks the first token itself (beam.h) */
                s->state = SEQ_RUNNING;
                continue;
            }
            if (s->ns) { /* n samples: their first tokens from the local prefill's logits, or
                          * from the priming step (nsamp.h) */
                if ((s->local || s->prime_given) &&
                    !pdm__nsamp_draw(n, s, s->local_logits, 1, cb, arg)) {
                    pdm__finish(n, s, "length", cb, arg); /* every sample ended at once */
                    continue;
                }
                s->state = SEQ_RUNNING;
                continue;
            }
            /* The first token (from the prefill side) is the first generated token. */
            pdm_decode_event_t ev = {.type = PDM_DECODE_EV_TOKEN, .id = s->id,
                                     .token = s->next, .index = 0,
                                     .logprob = s->want_lp && s->first_lp_known ? &s->first_lp
                                                                                : NULL};
            cb(arg, &ev);
            const char *why = pdm__append(n, s, s->next);
            if (why) {
                pdm__finish(n, s, why, cb, arg);
                continue;
            }
            s->state = SEQ_RUNNING;
        }
    }
    /* One batched step over up to max_batch running sequences (round robin when more). */
    pdm_decode_seq_t batch[n->p.max_batch];
    pdm__seq_t *who[n->p.max_batch];
    pdm_beam_kv_t *beams[n->p.max_batch];
    int nb = 0;
    for (int k = 0; k < n->p.max_sequences && nb < n->p.max_batch; k++) {
        pdm__seq_t *s = &n->seqs[(n->rr + k) % n->p.max_sequences];
        if (s->state != SEQ_RUNNING) continue;
        if (s->beam || s->ns) { /* its live beams / samples as consecutive rows, if they fit */
            int32_t in[PDM_BEAM_MAX_WIDTH];
            int nl = s->beam ? pdm_beam_search_inputs(s->beam, in) : pdm_nsamp_inputs(s->ns, in);
            if (nb + nl > n->p.max_batch) continue;
            for (int b = 0; b < nl; b++) {
                batch[nb] = (pdm_decode_seq_t){s->cache, in[b],
                                               n->logits + (size_t)nb * n->model->hp.n_vocab};
                beams[nb] = s->beam_kv;
                who[nb++] = s;
            }
            continue;
        }
        batch[nb] = (pdm_decode_seq_t){s->cache, s->next,
                                       n->logits + (size_t)nb * n->model->hp.n_vocab};
        beams[nb] = NULL;
        who[nb++] = s;
    }
    n->rr = (n->rr + 1) % n->p.max_sequences;
    if (nb) {
        double t0 = pdm_now();
        int st = pdm_decode_step_beams(n->ctx, &n->act, batch, beams, nb);
        double dt = pdm_now() - t0;
        for (int k = 0; k < nb; k++) {
            pdm__seq_t *s = who[k];
            if (s->state == SEQ_FREE || (k > 0 && who[k - 1] == s)) continue; /* beam rows */
            if (st) {
                pdm__fail(n, s, pdm_error_last(), 0, cb, arg);
                continue;
            }
            s->step_total += dt;
            s->steps++;
            if (s->beam) {
                int parent[PDM_BEAM_MAX_WIDTH], n_next;
                int rc = pdm_beam_search_advance(s->beam, batch[k].logits, parent, &n_next);
                if (rc < 0) pdm__fail(n, s, pdm_error_last(), 0, cb, arg);
                else if (rc) pdm__finish(n, s, "length", cb, arg);
                else pdm_beam_kv_reorder(s->beam_kv, parent, n_next);
                continue;
            }
            if (s->ns) {
                if (!pdm__nsamp_draw(n, s, batch[k].logits, 0, cb, arg))
                    pdm__finish(n, s, "length", cb, arg); /* (each sample's own end is kept) */
                continue;
            }
            pdm_token_logprobs_t lp;
            int32_t tok = pdm_sampler_sample(s->sampler, batch[k].logits,
                                             s->hist ? s->hist : s->tokens,
                                             s->n_done + s->n_tokens, &lp);
            s->next = tok;
            pdm_decode_event_t ev = {.type = PDM_DECODE_EV_TOKEN, .id = s->id, .token = tok,
                                     .index = s->n_tokens,
                                     .logprob = s->want_lp ? &lp : NULL};
            cb(arg, &ev);
            const char *why = pdm__append(n, s, tok);
            if (why) pdm__finish(n, s, why, cb, arg);
        }
    }
    int held = 0;
    for (int i = 0; i < n->p.max_sequences; i++) held += n->seqs[i].state != SEQ_FREE;
    return held;
}

int pdm_decode_node_offload_stats(pdm_decode_node_t *n, pdm_kvoff_stats_t *st)
{
    if (!n->offload) return PDM_ENOTFOUND;
    pdm_kvoff_engine_stats(n->offload, st);
    return PDM_OK;
}
