# bench/transfer/build.mk - the KV streaming benchmark binary, built against $(LIB) with the
# project's flags. Included by the top-level Makefile, or used without it:
#   make -f Makefile -f bench/transfer/build.mk BUILD=build-bench build-bench/bin/stream_bench
$(BUILD)/bin/stream_bench: bench/transfer/stream_bench.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $< $(LIB) -o $@ $(LDLIBS)
