# bench/decode/build.mk - the batched decode benchmark binary, built against $(LIB) with the
# project's flags. Included by the top-level Makefile, or used without it:
#   make -f Makefile -f bench/decode/build.mk BUILD=build-bench build-bench/bin/decode_bench
$(BUILD)/bin/decode_bench: bench/decode/decode_bench.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $< $(LIB) -o $@ $(LDLIBS)
