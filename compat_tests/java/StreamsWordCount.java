// A Kafka Streams word count with processing.guarantee=exactly_once_v2, for
// compat_tests/test_streams.py. setup.sh compiles it into compat_tests/.tools/java-classes;
// run: java -cp 'compat_tests/.tools/java-classes:compat_tests/.tools/java-lib/*' StreamsWordCount ARGS
//
// --bootstrap B --app-id A --input T --output T --state-dir D [--timeout S]
// Reads words (the record values) from the input topic, regroups them by word (a
// repartition topic with small segments, which Streams purges with DeleteRecords), counts
// them in a persistent (RocksDB) key-value store "counts" whose changelog is a compacted
// topic with small segments, and writes every new count to the output topic (key: the
// word, value: the count as a decimal string). Caching is off, so every word processed
// writes one changelog record and one output record. JSON lines on stdout:
//   {"ev": "state", "state": "RUNNING"}     (each state change of the KafkaStreams instance)
//   {"ev": "processed", "n": 1200}          (about every 200 words counted by this process)
// Runs until SIGTERM (a clean close) or the timeout; the tests also kill it with SIGKILL.

import java.time.Duration;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.common.utils.Bytes;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.kstream.Grouped;
import org.apache.kafka.streams.kstream.Materialized;
import org.apache.kafka.streams.kstream.Produced;
import org.apache.kafka.streams.state.KeyValueStore;
import org.apache.kafka.streams.state.Stores;

public class StreamsWordCount {
    static synchronized void emit(String json) {
        System.out.println(json);
        System.out.flush();
    }

    public static void main(String[] argv) throws Exception {
        String bootstrap = null, appId = null, input = null, output = null, stateDir = null;
        double timeoutS = 300;
        for (int i = 0; i + 1 < argv.length; i += 2) {
            String v = argv[i + 1];
            switch (argv[i]) {
                case "--bootstrap" -> bootstrap = v;
                case "--app-id" -> appId = v;
                case "--input" -> input = v;
                case "--output" -> output = v;
                case "--state-dir" -> stateDir = v;
                case "--timeout" -> timeoutS = Double.parseDouble(v);
                default -> throw new IllegalArgumentException("unknown option " + argv[i]);
            }
        }
        Properties props = new Properties();
        props.put(StreamsConfig.APPLICATION_ID_CONFIG, appId);
        props.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.EXACTLY_ONCE_V2);
        props.put(StreamsConfig.STATE_DIR_CONFIG, stateDir);
        props.put(StreamsConfig.COMMIT_INTERVAL_MS_CONFIG, 200);
        props.put(StreamsConfig.STATESTORE_CACHE_MAX_BYTES_CONFIG, 0);
        props.put(StreamsConfig.REPLICATION_FACTOR_CONFIG, 1);
        // A restarted instance must get its tasks back quickly: a short session (the old
        // member of a killed process is expired) and no probing rebalances.
        props.put(StreamsConfig.consumerPrefix("session.timeout.ms"), 6000);
        props.put(StreamsConfig.consumerPrefix("heartbeat.interval.ms"), 1000);
        props.put(StreamsConfig.producerPrefix("transaction.timeout.ms"), 10000);
        props.put(StreamsConfig.producerPrefix("delivery.timeout.ms"), 60000);
        // Small batches (a few records each): the cleaner removes whole batches only, so a
        // changelog written in big ones would keep most of its records (each holds a last
        // value); with these most of it goes.
        props.put(StreamsConfig.producerPrefix("batch.size"), 256);
        // Small segments for the internal topics too: the repartition topic, which Streams
        // purges with DeleteRecords up to what it consumed (often its end), then rolls
        // segments past the purged ones, as a broker killed mid-run must recover. Purged
        // at every commit rather than every 30 s.
        props.put(StreamsConfig.topicPrefix("segment.bytes"), 1024);
        props.put(StreamsConfig.REPARTITION_PURGE_INTERVAL_MS_CONFIG, 200);

        StreamsBuilder builder = new StreamsBuilder();
        // small changelog segments and an eager cleaner: the test sees it compacted
        Map<String, String> changelog = Map.of(
                "segment.bytes", "1024",
                "min.cleanable.dirty.ratio", "0.01",
                "delete.retention.ms", "1000");
        AtomicLong processed = new AtomicLong();
        builder.stream(input, Consumed.with(Serdes.String(), Serdes.String()))
                .groupBy((k, word) -> word, Grouped.with("words", Serdes.String(), Serdes.String()))
                .count(Materialized.<String, Long>as(Stores.persistentKeyValueStore("counts"))
                        .withKeySerde(Serdes.String())
                        .withValueSerde(Serdes.Long())
                        .withCachingDisabled()
                        .withLoggingEnabled(changelog))
                .toStream()
                .peek((word, n) -> {
                    long p = processed.incrementAndGet();
                    if (p % 200 == 0) {
                        emit("{\"ev\": \"processed\", \"n\": " + p + "}");
                    }
                })
                .mapValues(n -> Long.toString(n))
                .to(output, Produced.with(Serdes.String(), Serdes.String()));

        KafkaStreams streams = new KafkaStreams(builder.build(), props);
        CountDownLatch done = new CountDownLatch(1);
        streams.setStateListener((now, before) -> {
            emit("{\"ev\": \"state\", \"state\": \"" + now + "\"}");
            if (now == KafkaStreams.State.ERROR || now == KafkaStreams.State.NOT_RUNNING) {
                done.countDown();
            }
        });
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            streams.close(Duration.ofSeconds(20));
            done.countDown();
        }));
        streams.start();
        done.await((long) (timeoutS * 1000), TimeUnit.MILLISECONDS);
        streams.close(Duration.ofSeconds(20));
        emit("{\"ev\": \"closed\", \"processed\": " + processed.get() + "}");
    }
}
