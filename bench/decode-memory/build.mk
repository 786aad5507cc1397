# bench/decode-memory/build.mk - the head-wise offload benchmark binary, built against $(LIB)
# with the project's flags. Included by the top-level Makefile.
$(BUILD)/bin/offload_bench: bench/decode-memory/offload_bench.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $< $(LIB) -o $@ $(LDLIBS)
