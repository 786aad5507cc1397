# bench/decode-memory/build.mk - the decode-memory benchmark binaries (beam_bench: beam-search
# memory and latency; offload_bench: head-wise offload; window_bench: windowed local layers),
# built against $(LIB) with the project's flags. Included by the top-level Makefile.
$(BUILD)/bin/beam_bench: bench/decode-memory/beam_bench.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $< $(LIB) -o $@ $(LDLIBS)

$(BUILD)/bin/offload_bench: bench/decode-memory/offload_bench.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $< $(LIB) -o $@ $(LDLIBS)

$(BUILD)/bin/window_bench: bench/decode-memory/window_bench.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $< $(LIB) -o $@ $(LDLIBS)
