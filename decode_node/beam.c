/*
 * beam.c - the segmented beam-search KV cache (Wu et al., "Efficient LLM inference solution on
 * Intel GPU", §3.2 segment KV cache, §3.3 customized SDPA with index-select fusion).
 *
 * The prompt KV is the sequence's pdm_kv_cache_t, filled by the prefill ranks' stream and
 * never written here. Response KV: segment s holds response steps [16 s, 16 s + 16) of every
 * beam slot, per (layer, kv head) a K array and a V array of [16][width][head_dim] ("sequence
 * first": one step's rows of all beams are adjacent, so a step's K/V are written side by
 * side). A step writes only its own rows, so rows referenced by live beams are never
 * overwritten: a finished or abandoned beam's rows simply stop being referenced.
 */
#include "decode_node/decode.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

void pdm_beam_params_default(pdm_beam_params_t *p)
{
    p->width = 0;
    p->length_penalty = 1.0f;
    p->n_best = 1;
    p->early_stopping = PDM_BEAM_STOP_HEURISTIC;
}

int pdm_beam_params_check(const pdm_beam_params_t *p)
{
    if (p->width < 0 || p->width > PDM_BEAM_MAX_WIDTH)
        return pdm_error_set(PDM_EINVAL, "beams must be 1..%d (0: off), not %d",
                             PDM_BEAM_MAX_WIDTH, p->width);
    if (p->width == 0) return PDM_OK;
    if (p->n_best < 1 || p->n_best > p->width)
        return pdm_error_set(PDM_EINVAL, "n-best must be 1..beams (%d), not %d", p->width,
                             p->n_best);
    if (!isfinite(p->length_penalty) || fabsf(p->length_penalty) > 100)
        return pdm_error_set(PDM_EINVAL, "length penalty must be a number in [-100, 100]");
    if (p->early_stopping < PDM_BEAM_STOP_HEURISTIC || p->early_stopping > PDM_BEAM_STOP_NEVER)
        return pdm_error_set(PDM_EINVAL, "unknown early-stopping rule %d", (int)p->early_stopping);
    return PDM_OK;
}

int pdm_beam_stop_parse(const char *s, pdm_beam_stop_t *out)
{
    if (!strcmp(s, "heuristic") || !strcmp(s, "false")) *out = PDM_BEAM_STOP_HEURISTIC;
    else if (!strcmp(s, "early") || !strcmp(s, "true")) *out = PDM_BEAM_STOP_EARLY;
    else if (!strcmp(s, "never")) *out = PDM_BEAM_STOP_NEVER;
    else
        return pdm_error_set(PDM_EINVAL, "early stopping must be heuristic, early or never, not "
                             "'%s'", s);
    return PDM_OK;
}

const char *pdm_beam_stop_name(pdm_beam_stop_t s)
{
    return s == PDM_BEAM_STOP_EARLY ? "early" : s == PDM_BEAM_STOP_NEVER ? "never" : "heuristic";
}

/* eq. (1): bytes of one token's K and V over all layers and kv heads */
static size_t pdm__cache_token(const pdm_model_hparams_t *hp, pdm_dtype_t dtype)
{
    return 2 * (size_t)hp->n_layers * hp->n_kv_heads * pdm_dtype_row_bytes(dtype, hp->head_dim);
}

static int64_t pdm__round_step(int64_t n)
{
    return (n + PDM_BEAM_STEP - 1) / PDM_BEAM_STEP * PDM_BEAM_STEP;
}

size_t pdm_beam_bytes_standard(const pdm_model_hparams_t *hp, pdm_dtype_t dtype, int width,
                               int64_t n_prompt, int64_t n_response)
{
    return (size_t)width * (size_t)(n_prompt + n_response) * pdm__cache_token(hp, dtype); /* (2) */
}

size_t pdm_beam_bytes_segment(const pdm_model_hparams_t *hp, pdm_dtype_t dtype, int width,
                              int64_t n_prompt, int64_t n_response)
{
    return (size_t)(n_prompt + width * pdm__round_step(n_response)) *
           pdm__cache_token(hp, dtype); /* (3) */
}

int64_t pdm_beam_kv_slots(int width, int32_t n_prompt, int32_t max_new)
{
    return (int64_t)n_prompt + (int64_t)width * pdm__round_step(max_new);
}

int pdm_beam_kv_create(const pdm_model_hparams_t *hp, const pdm_kv_cache_t *prompt,
                       int32_t n_prompt, int width, int32_t max_steps, pdm_beam_kv_t **out)
{
    if (width < 1 || width > PDM_BEAM_MAX_WIDTH || max_steps < 1 || n_prompt < 1 ||
        n_prompt > prompt->capacity)
        return pdm_error_set(PDM_EINVAL, "beam KV: width %d, %d steps, prompt of %d tokens",
                             width, max_steps, n_prompt);
    pdm_beam_kv_t *kv = calloc(1, sizeof(*kv));
    if (!kv) return pdm_error_set(PDM_ENOMEM, "beam KV: out of memory");
    kv->n_layers = hp->n_layers;
    kv->n_kv_heads = hp->n_kv_heads;
    kv->head_dim = hp->head_dim;
    kv->dtype = prompt->dtype;
    kv->width = width;
    kv->prompt = prompt;
    kv->n_prompt = n_prompt;
    kv->max_steps = max_steps;
    kv->n_live = 1;
    kv->head_bytes = (size_t)PDM_BEAM_STEP * width * pdm_dtype_row_bytes(kv->dtype, hp->head_dim);
    const size_t n_table = (size_t)width * max_steps;
    const int max_seg = (int)((max_steps + PDM_BEAM_STEP - 1) / PDM_BEAM_STEP);
    kv->seg = calloc((size_t)max_seg, sizeof(void *));
    kv->table = calloc(n_table, sizeof(int32_t));
    kv->table_tmp = calloc(n_table, sizeof(int32_t));
    kv->resp_o = malloc(sizeof(float) * (size_t)width * hp->n_heads * hp->head_dim);
    kv->resp_lse = malloc(sizeof(float) * (size_t)width * hp->n_heads);
    kv->part_o = malloc(sizeof(float) * (size_t)hp->n_heads * hp->head_dim);
    kv->part_lse = malloc(sizeof(float) * (size_t)hp->n_heads);
    kv->pos_tmp = malloc(sizeof(int32_t) * (size_t)hp->n_heads);
    if (!kv->seg || !kv->table || !kv->table_tmp || !kv->resp_o || !kv->resp_lse ||
        !kv->part_o || !kv->part_lse || !kv->pos_tmp) {
        pdm_beam_kv_destroy(kv);
        return pdm_error_set(PDM_ENOMEM, "beam KV: out of memory");
    }
    *out = kv;
    return PDM_OK;
}

int pdm_beam_kv_scratch(pdm_model_ctx_t *ctx, pdm_beam_kv_t *kv)
{
    const int n_split = 2 * pdm_kern_pool_size(pdm_model_ctx_pool(ctx));
    if (kv->prompt_part && kv->n_split == n_split) return PDM_OK;
    const pdm_model_hparams_t *hp = &pdm_model_ctx_model(ctx)->hp;
    const size_t rows = (size_t)kv->width * hp->n_heads; /* beams x query heads */
    free(kv->prompt_part);
    free(kv->prompt_q);
    free(kv->prompt_pos);
    kv->prompt_part = malloc(sizeof(float) * (size_t)n_split * rows * (hp->head_dim + 1));
    kv->prompt_q = malloc(sizeof(float) * rows * hp->head_dim);
    kv->prompt_pos = malloc(sizeof(int32_t) * rows);
    kv->n_split = n_split;
    if (!kv->prompt_part || !kv->prompt_q || !kv->prompt_pos) {
        free(kv->prompt_part);
        kv->prompt_part = NULL;
        return pdm_error_set(PDM_ENOMEM, "beam KV: out of memory");
    }
    return PDM_OK;
}

void pdm_beam_kv_destroy(pdm_beam_kv_t *kv)
{
    if (!kv) return;
    free(kv->prompt_part);
    free(kv->prompt_q);
    free(kv->prompt_pos);
    for (int s = 0; s < kv->n_seg; s++) free(kv->seg[s]);
    free(kv->seg);
    free(kv->table);
    free(kv->table_tmp);
    free(kv->resp_o);
    free(kv->resp_lse);
    free(kv->part_o);
    free(kv->part_lse);
    free(kv->pos_tmp);
    free(kv);
}

int pdm_beam_kv_prepare(pdm_beam_kv_t *kv)
{
    if (!kv->primed) return PDM_OK; /* the priming step stores nothing */
    if (kv->n_steps >= kv->max_steps)
        return pdm_error_set(PDM_EOVERFLOW, "beam KV: all %d response steps used", kv->max_steps);
    const int s = kv->n_steps / PDM_BEAM_STEP;
    if (s < kv->n_seg) return PDM_OK;
    /* A new segment of 16 steps for every beam (§3.2: N_step grows by step = 16). */
    const size_t bytes = kv->head_bytes * 2 * kv->n_layers * kv->n_kv_heads;
    void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!p) return pdm_error_set(PDM_ENOMEM, "beam KV: cannot allocate a segment of %zu bytes",
                                 bytes);
    memset(p, 0, bytes); /* defined bytes throughout (attention reads only written rows) */
    kv->seg[kv->n_seg++] = p;
    kv->bytes += bytes;
    return PDM_OK;
}

int32_t pdm_beam_kv_next_pos(const pdm_beam_kv_t *kv)
{
    return kv->prompt->pos0 + kv->n_prompt - 1 + (kv->primed ? 1 + kv->n_steps : 0);
}

/* K (kv = 0) or V (kv = 1) array of (layer, head) in segment s */
static char *pdm__seg_head(const pdm_beam_kv_t *kv, int s, uint32_t layer, uint32_t head, int k_or_v)
{
    size_t idx = ((size_t)layer * kv->n_kv_heads + head) * 2 + (size_t)k_or_v;
    return (char *)kv->seg[s] + idx * kv->head_bytes;
}

/* The prompt part: work items are (kv head, range of prompt keys), as in the engine's decode
 * attention (flash-decoding), but one item's query block holds the group's query heads of
 * every beam: each prompt K/V tile is converted once for all beams and heads sharing it
 * (§3.3: Q [1, BW, D] against K/V_prompt [N_prompt, D] in one work group). */
typedef struct {
    const pdm_kern_ops_t *ops;
    const pdm_model_t *model;
    int layer;
    const pdm_kv_view_t *view;
    const pdm_beam_kv_t *kv;
    int n_rows, hd, n_split, n_kv_heads;
    atomic_int next;
} pdm__prompt_task_t;

static void pdm__prompt_task(void *arg, int ith, int nth)
{
    pdm__prompt_task_t *t = arg;
    const pdm_beam_kv_t *kv = t->kv;
    const int hd = t->hd, nr = t->n_rows;
    (void)ith;
    (void)nth;
    for (;;) {
        int item = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
        if (item >= t->n_kv_heads * t->n_split) break;
        int kvh = item / t->n_split, sp = item % t->n_split;
        float *part = kv->prompt_part + (size_t)item * nr * (hd + 1), *lse = part + (size_t)nr * hd;
        int64_t b, e;
        pdm_kern_split(t->view->n_tokens, sp, t->n_split, 32, &b, &e);
        if (b >= e) {
            for (int r = 0; r < nr; r++) lse[r] = -INFINITY;
            continue;
        }
        size_t off = (size_t)b * hd * pdm_dtype_row_bytes(t->view->dtype, 1);
        pdm_kern_attn_t a = {.q = kv->prompt_q + (size_t)kvh * nr * hd, .q_stride = hd,
                             .q_pos = kv->prompt_pos, .n_q = nr,
                             .k = (const char *)t->view->k[kvh] + off,
                             .v = (const char *)t->view->v[kvh] + off,
                             .kv_type = t->view->dtype, .k_scale = t->view->k_scale[kvh],
                             .v_scale = t->view->v_scale[kvh],
                             .k_pos0 = t->view->pos0 + (int32_t)b,
                             .n_kv = (int)(e - b), .head_dim = hd, .o = part,
                             .o_stride = hd, .lse = lse, .lse_stride = 1};
        pdm_model_attn_setup(t->model, t->layer, &a);
        t->ops->attention(&a);
    }
}

void pdm_beam_attend_prompt(pdm_model_ctx_t *ctx, pdm_beam_kv_t *kv, int layer,
                            pdm_act_t *rows, const pdm_kv_view_t *view)
{
    const pdm_kern_ops_t *ops = pdm_model_ctx_ops(ctx);
    const pdm_model_hparams_t *hp = &pdm_model_ctx_model(ctx)->hp;
    const int hd = (int)hp->head_dim, n_heads = (int)hp->n_heads, nkv = (int)hp->n_kv_heads;
    const int group = n_heads / nkv, nr = rows->n * group;
    const size_t qdim = (size_t)n_heads * hd;
    /* gather q as [kv head][beam][group head][hd]; rows of a beam search share a position */
    for (int h = 0; h < nkv; h++)
        for (int b = 0; b < rows->n; b++)
            memcpy(kv->prompt_q + ((size_t)h * nr + (size_t)b * group) * hd,
                   rows->q + (size_t)b * qdim + (size_t)h * group * hd,
                   sizeof(float) * (size_t)group * hd);
    for (int r = 0; r < nr; r++) kv->prompt_pos[r] = rows->pos[0];
    pdm__prompt_task_t t = {.ops = ops, .model = pdm_model_ctx_model(ctx), .layer = layer,
                            .view = view, .kv = kv, .n_rows = nr, .hd = hd,
                            .n_split = kv->n_split, .n_kv_heads = nkv};
    atomic_init(&t.next, 0);
    pdm_kern_pool_run(pdm_model_ctx_pool(ctx), pdm__prompt_task, &t);
    /* merge the key ranges in order into each row's o / lse */
    for (int h = 0; h < nkv; h++)
        for (int r = 0; r < nr; r++) {
            const int b = r / group, head = h * group + r % group;
            float *o = rows->o + (size_t)b * qdim + (size_t)head * hd;
            float *lse = rows->lse + (size_t)b * n_heads + head;
            memset(o, 0, sizeof(float) * (size_t)hd);
            *lse = -INFINITY;
            for (int sp = 0; sp < kv->n_split; sp++) {
                const float *part = kv->prompt_part + ((size_t)h * kv->n_split + sp) * nr * (hd + 1);
                ops->attn_merge(o, lse, part + (size_t)r * hd, part[(size_t)nr * hd + r], hd);
            }
        }
}

void pdm_beam_kv_attend(pdm_model_ctx_t *ctx, pdm_beam_kv_t *kv, int layer, pdm_act_t *rows)
{
    const pdm_kern_ops_t *ops = pdm_model_ctx_ops(ctx);
    const pdm_model_hparams_t *hp = &pdm_model_ctx_model(ctx)->hp;
    const int n = rows->n, hd = (int)hp->head_dim, n_heads = (int)hp->n_heads;
    const size_t qdim = (size_t)n_heads * hd, kvdim = (size_t)hp->n_kv_heads * hd;
    const size_t row_bytes = pdm_dtype_row_bytes(kv->dtype, hd);
    pdm_kv_view_t prompt_view;
    pdm_kv_cache_view(kv->prompt, (uint32_t)layer, 0, kv->n_prompt, &prompt_view);
    if (!kv->primed) {
        /* Recomputing the last prompt token: its KV is already in the prompt (from the prefill
         * ranks); only its output is needed. */
        pdm_beam_attend_prompt(ctx, kv, layer, rows, &prompt_view);
        return;
    }
    const int t = kv->n_steps, seg_now = t / PDM_BEAM_STEP;
    /* 1. This step's K/V of beam b go to row (t % 16) * width + b of the current segment.
     * q8: with the head's scales fixed from the prompt, like every row after the prompt of a
     * q8 cache (model/kv_quant.c); nothing is re-quantized. */
    const float *scales = kv->dtype == PDM_DT_I8 ? kv->prompt->scale : NULL;
    for (int b = 0; b < n; b++) {
        size_t off = (size_t)((t % PDM_BEAM_STEP) * kv->width + b) * row_bytes;
        for (uint32_t h = 0; h < hp->n_kv_heads; h++) {
            const float *k = rows->k + (size_t)b * kvdim + (size_t)h * hd;
            const float *v = rows->v + (size_t)b * kvdim + (size_t)h * hd;
            char *kd = pdm__seg_head(kv, seg_now, (uint32_t)layer, h, 0) + off;
            char *vd = pdm__seg_head(kv, seg_now, (uint32_t)layer, h, 1) + off;
            if (scales) {
                const float *s = scales + 2 * ((size_t)layer * hp->n_kv_heads + h);
                pdm_q8_quantize_row(k, (int8_t *)kd, hd, s[0]);
                pdm_q8_quantize_row(v, (int8_t *)vd, hd, s[1]);
            } else {
                ops->kv_store(kv->dtype, k, kd, hd);
                ops->kv_store(kv->dtype, v, vd, hd);
            }
        }
        kv->table[(size_t)b * kv->max_steps + t] = (t % PDM_BEAM_STEP) * kv->width + b;
    }
    /* 2. Each beam against its own response steps [0, t], segment by segment, the rows picked
     * through the table (index select fused into the attention, §3.3). At most 16 keys per
     * segment and a few segments: computed here on the calling thread, so a step costs one
     * thread-pool dispatch per layer (the prompt part below) whatever the width. */
    const int n_seg = seg_now + 1, group = n_heads / (int)hp->n_kv_heads;
    for (int b = 0; b < n; b++) {
        for (int g = 0; g < group; g++) kv->pos_tmp[g] = rows->pos[b];
        for (uint32_t h = 0; h < hp->n_kv_heads; h++) {
            float *o = kv->resp_o + (size_t)b * qdim + (size_t)h * group * hd;
            float *lse = kv->resp_lse + (size_t)b * n_heads + (size_t)h * group;
            pdm_kern_attn_t a = {.q = rows->q + (size_t)b * qdim + (size_t)h * group * hd,
                                 .q_stride = hd, .q_pos = kv->pos_tmp, .n_q = group,
                                 .kv_type = kv->dtype, .head_dim = hd,
                                 .k_scale = prompt_view.k_scale[h],
                                 .v_scale = prompt_view.v_scale[h]};
            pdm_model_attn_setup(pdm_model_ctx_model(ctx), layer, &a);
            for (int s = 0; s < n_seg; s++) {
                a.k = pdm__seg_head(kv, s, (uint32_t)layer, h, 0);
                a.v = pdm__seg_head(kv, s, (uint32_t)layer, h, 1);
                a.k_pos0 = kv->prompt->pos0 + kv->n_prompt + s * PDM_BEAM_STEP;
                a.n_kv = PDM_MIN(PDM_BEAM_STEP, t + 1 - s * PDM_BEAM_STEP);
                a.o = s ? kv->part_o : o;
                a.o_stride = hd;
                a.lse = s ? kv->part_lse : lse;
                a.lse_stride = 1;
                ops->attention_rows(&a, kv->table + (size_t)b * kv->max_steps + s * PDM_BEAM_STEP);
                for (int g = 0; s && g < group; g++)
                    ops->attn_merge(o + (size_t)g * hd, lse + g, kv->part_o + (size_t)g * hd,
                                    kv->part_lse[g], hd);
            }
        }
    }
    /* 3. All beams against the shared prompt in one pass. */
    pdm_beam_attend_prompt(ctx, kv, layer, rows, &prompt_view);
    /* 4. Merge the two parts by log-sum-exp. */
    for (int b = 0; b < n; b++)
        for (int h = 0; h < n_heads; h++)
            ops->attn_merge(rows->o + (size_t)b * qdim + (size_t)h * hd,
                            rows->lse + (size_t)b * n_heads + h,
                            kv->resp_o + (size_t)b * qdim + (size_t)h * hd,
                            kv->resp_lse[(size_t)b * n_heads + h], hd);
}

int pdm_beam_step_check(pdm_model_ctx_t *ctx, pdm_beam_kv_t *const *beams, int n)
{
    pdm_beam_kv_t *kv = beams[0];
    int st = pdm_beam_kv_scratch(ctx, kv);
    if (st) return st;
    if (kv->n_live > n)
        return pdm_error_set(PDM_EINVAL, "decode: a beam search needs %d consecutive rows, the "
                             "batch has %d left", kv->n_live, n);
    for (int b = 1; b < kv->n_live; b++)
        if (beams[b] != kv)
            return pdm_error_set(PDM_EINVAL, "decode: the %d rows of a beam search must be "
                                 "consecutive", kv->n_live);
    return pdm_beam_kv_prepare(kv);
}

void pdm_beam_kv_commit(pdm_beam_kv_t *kv)
{
    if (!kv->primed) kv->primed = 1;
    else kv->n_steps++;
}

void pdm_beam_kv_reorder(pdm_beam_kv_t *kv, const int *parent, int n)
{
    /* Only the integer table moves: beam b's history becomes its parent's (§3.3, Indices). */
    const size_t len = (size_t)kv->n_steps;
    for (int b = 0; b < n; b++)
        memcpy(kv->table_tmp + (size_t)b * kv->max_steps,
               kv->table + (size_t)parent[b] * kv->max_steps, len * sizeof(int32_t));
    int32_t *tmp = kv->table;
    kv->table = kv->table_tmp;
    kv->table_tmp = tmp;
    kv->n_live = n;
}
