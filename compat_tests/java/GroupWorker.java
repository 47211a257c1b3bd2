// One consumer-group member with the Java consumer (kafka-clients from the pinned jars),
// run in source-file mode: java -cp 'compat_tests/.tools/java-lib/*' GroupWorker.java ARGS
//
// The Java twin of compat_tests/workers/groupclient.py: --bootstrap B --topic T --group G
// [--protocol consumer|classic] [--delay-ms N] [--stop-file F] [--timeout S]. Subscribes
// (auto-commit off), and for every record prints it, sleeps --delay-ms, then commits
// offset+1 synchronously. JSON lines on stdout:
//   {"ev": "assigned", "parts": [0, 2], "t": <wall seconds>}   (its whole set, after each change)
//   {"ev": "rec", "p": 0, "o": 17, "v": "..."}
//   {"ev": "closed", "n": <records>}
// Stops (closing the consumer, which leaves the group) when the stop file exists or at the timeout.

import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Collection;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.TreeSet;
import org.apache.kafka.clients.consumer.ConsumerRebalanceListener;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.common.KafkaException;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.StringDeserializer;

public class GroupWorker {
    static synchronized void emit(String json) {
        System.out.println(json);
        System.out.flush();
    }

    static String quote(String s) {
        return "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"") + "\"";
    }

    public static void main(String[] argv) throws Exception {
        String bootstrap = null, topic = null, group = null, stopFile = null, protocol = "consumer";
        long delayMs = 0;
        double timeoutS = 120;
        for (int i = 0; i < argv.length; i += 2) {
            String v = argv[i + 1];
            switch (argv[i]) {
                case "--bootstrap" -> bootstrap = v;
                case "--topic" -> topic = v;
                case "--group" -> group = v;
                case "--protocol" -> protocol = v;
                case "--delay-ms" -> delayMs = Long.parseLong(v);
                case "--stop-file" -> stopFile = v;
                case "--timeout" -> timeoutS = Double.parseDouble(v);
                default -> { /* the classic workers' --session-ms and such: not ours */ }
            }
        }
        Properties props = new Properties();
        props.put("bootstrap.servers", bootstrap);
        props.put("group.id", group);
        props.put("group.protocol", protocol);
        props.put("enable.auto.commit", "false");
        props.put("auto.offset.reset", "earliest");
        props.put("max.poll.records", "10");
        props.put("key.deserializer", StringDeserializer.class.getName());
        props.put("value.deserializer", StringDeserializer.class.getName());
        long deadline = System.nanoTime() + (long) (timeoutS * 1e9);
        int n = 0;
        try (KafkaConsumer<String, String> c = new KafkaConsumer<>(props)) {
            c.subscribe(List.of(topic), new ConsumerRebalanceListener() {
                @Override
                public void onPartitionsRevoked(Collection<TopicPartition> partitions) {}

                @Override
                public void onPartitionsAssigned(Collection<TopicPartition> partitions) {
                    TreeSet<Integer> parts = new TreeSet<>();
                    for (TopicPartition tp : c.assignment()) parts.add(tp.partition());
                    emit("{\"ev\": \"assigned\", \"parts\": " + parts + ", \"t\": " + System.currentTimeMillis() / 1000.0 + "}");
                }
            });
            while (!(stopFile != null && Files.exists(Path.of(stopFile))) && System.nanoTime() < deadline) {
                for (ConsumerRecord<String, String> r : c.poll(Duration.ofMillis(200))) {
                    emit("{\"ev\": \"rec\", \"p\": " + r.partition() + ", \"o\": " + r.offset() + ", \"v\": " + quote(r.value()) + "}");
                    Thread.sleep(delayMs);
                    n++;
                    try {
                        c.commitSync(Map.of(new TopicPartition(r.topic(), r.partition()), new OffsetAndMetadata(r.offset() + 1)));
                    } catch (KafkaException e) {  // CommitFailedException among them
                        // A rebalance took the partition: its next owner reads the record again.
                        System.err.println("commit failed: " + e);
                    }
                }
            }
        }
        emit("{\"ev\": \"closed\", \"n\": " + n + "}");
    }
}
