# bench/decode-memory/build.mk - the beam-search memory/latency benchmark (beam_bench), built
# against $(LIB) with the project's flags. Included by the top-level Makefile.
$(BUILD)/bin/beam_bench: bench/decode-memory/beam_bench.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $< $(LIB) -o $@ $(LDLIBS)
