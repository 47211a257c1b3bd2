package main

// The sarama side (github.com/IBM/sarama): AsyncProducer, Consumer (assign mode),
// ConsumerGroup and ClusterAdmin, on sarama's default protocol version. sarama's producer
// is NOT idempotent by default; --idempotence on turns it on with the settings sarama
// requires for it (acks=all, one in-flight request per broker, retries).

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/IBM/sarama"
)

type saramaDriver struct{}

func init() {
	if os.Getenv("HKGO_DEBUG") != "" {
		sarama.Logger = log.New(os.Stderr, "[sarama] ", log.LstdFlags|log.Lmicroseconds)
	}
}

// saramaConfig: the configuration every client starts from, with --spec's TLS and SASL.
// sarama asks for topic auto-creation by default (Metadata.AllowAutoTopicCreation), so
// --auto-create changes nothing for it.
func saramaConfig(o opts) *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.ClientID = "hk-compat-sarama"
	if err := saramaSecurity(cfg, o.spec); err != nil {
		fail("security options: %v", err)
	}
	return cfg
}

func saramaCodec(name string) (sarama.CompressionCodec, error) {
	switch name {
	case "none":
		return sarama.CompressionNone, nil
	case "gzip":
		return sarama.CompressionGZIP, nil
	case "snappy":
		return sarama.CompressionSnappy, nil
	case "lz4":
		return sarama.CompressionLZ4, nil
	case "zstd":
		return sarama.CompressionZSTD, nil
	}
	return sarama.CompressionNone, fmt.Errorf("unknown codec %q", name)
}

// saramaCode is the Kafka error code inside err: 0 for nil, -1 when it is not a Kafka error.
func saramaCode(err error) int {
	if err == nil {
		return 0
	}
	var te *sarama.TopicError
	if errors.As(err, &te) {
		return int(te.Err)
	}
	var ke sarama.KError
	if errors.As(err, &ke) {
		return int(ke)
	}
	return -1
}

func (saramaDriver) produce(o opts, recs []rec) (map[string]any, error) {
	cfg := saramaConfig(o)
	codec, err := saramaCodec(o.codec)
	if err != nil {
		return nil, err
	}
	cfg.Producer.Compression = codec
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	cfg.Producer.Return.Successes = true
	cfg.Producer.Return.Errors = true
	cfg.Producer.Flush.Frequency = 5 * time.Millisecond
	if o.maxBatch > 0 {
		cfg.Producer.MaxMessageBytes = o.maxBatch
	}
	cfg.Producer.Timeout = 30 * time.Second
	switch o.acks {
	case "all":
		cfg.Producer.RequiredAcks = sarama.WaitForAll
	case "1":
		cfg.Producer.RequiredAcks = sarama.WaitForLocal
	case "0":
		cfg.Producer.RequiredAcks = sarama.NoResponse
	}
	if o.idempotence == "on" {
		cfg.Producer.Idempotent = true
		cfg.Producer.RequiredAcks = sarama.WaitForAll
		cfg.Net.MaxOpenRequests = 1
		cfg.Producer.Retry.Max = 5
	}
	p, err := sarama.NewAsyncProducer([]string{o.bootstrap}, cfg)
	if err != nil {
		return nil, err
	}
	offsets := make([]int64, len(recs))
	errs := make([]error, len(recs))
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for m := range p.Successes() {
			offsets[m.Metadata.(int)] = m.Offset
		}
	}()
	go func() {
		defer wg.Done()
		for e := range p.Errors() {
			errs[e.Msg.Metadata.(int)] = e.Err
		}
	}()
	for i, r := range recs {
		m := &sarama.ProducerMessage{Topic: o.topic, Partition: int32(o.partition), Metadata: i}
		// A nil Encoder is a null key/value; a zero-length ByteEncoder is an empty one.
		if r.Key != nil {
			m.Key = sarama.ByteEncoder(r.Key)
		}
		if r.Value != nil {
			m.Value = sarama.ByteEncoder(r.Value)
		}
		for _, h := range r.Headers {
			m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(h.Name), Value: h.Value})
		}
		if r.Timestamp != nil {
			m.Timestamp = time.UnixMilli(*r.Timestamp)
		}
		p.Input() <- m
	}
	p.AsyncClose() // flushes everything, then closes Successes and Errors
	wg.Wait()
	return produceResult(o, offsets, errs, saramaCode)
}

func saramaRec(m *sarama.ConsumerMessage) rec {
	out := rec{Key: m.Key, Value: m.Value, Offset: m.Offset, Partition: m.Partition}
	ts := m.Timestamp.UnixMilli()
	out.Timestamp = &ts
	for _, h := range m.Headers {
		out.Headers = append(out.Headers, hdr{string(h.Key), h.Value})
	}
	return out
}

func (saramaDriver) consume(o opts) ([]rec, int64, map[string]any, error) {
	cfg := saramaConfig(o)
	cfg.Consumer.Return.Errors = true
	client, err := sarama.NewClient([]string{o.bootstrap}, cfg)
	if err != nil {
		return nil, 0, nil, err
	}
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, 0, nil, err
	}
	defer consumer.Close()
	pc, err := consumer.ConsumePartition(o.topic, int32(o.partition), o.offset)
	if err != nil {
		return nil, 0, nil, err
	}
	var out []rec
	c := newClock(o)
	take := func(wait time.Duration) error {
		t := time.NewTimer(wait)
		defer t.Stop()
		for {
			select {
			case m := <-pc.Messages():
				out = append(out, saramaRec(m))
				if len(out) >= o.count && wait > 300*time.Millisecond {
					return nil
				}
			case e := <-pc.Errors():
				return e
			case <-t.C:
				return nil
			}
		}
	}
	for len(out) < o.count && c.goOn(len(out)) {
		if err := take(500 * time.Millisecond); err != nil {
			return nil, 0, nil, err
		}
	}
	// Anything past the expected count is a duplicate or a stray: collect it to report.
	if err := take(300 * time.Millisecond); err != nil {
		return nil, 0, nil, err
	}
	pc.AsyncClose()
	hwm, err := client.GetOffset(o.topic, int32(o.partition), sarama.OffsetNewest)
	if err != nil {
		return nil, 0, nil, err
	}
	return out, hwm, nil, nil
}

// groupHandler reports assignments and records; one record at a time across all claims,
// so that every reported record is marked before the member counts it and stops.
type groupHandler struct {
	o    opts
	st   *stopper
	work sync.Mutex
	stop func()
}

func (h *groupHandler) Setup(s sarama.ConsumerGroupSession) error {
	parts := append([]int32{}, s.Claims()[h.o.topic]...)
	sort.Slice(parts, func(i, j int) bool { return parts[i] < parts[j] })
	emit(map[string]any{"ev": "assigned", "parts": parts, "t": float64(time.Now().UnixNano()) / 1e9})
	return nil
}

func (h *groupHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h *groupHandler) ConsumeClaim(s sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	for {
		select {
		case <-s.Context().Done():
			return nil
		case m, ok := <-claim.Messages():
			if !ok {
				return nil
			}
			h.work.Lock()
			if h.st.now() {
				h.work.Unlock()
				h.stop()
				return nil
			}
			emit(map[string]any{"ev": "rec", "p": m.Partition, "o": m.Offset, "v": string(m.Value)})
			time.Sleep(time.Duration(h.o.delayMs) * time.Millisecond)
			s.MarkMessage(m, "") // offset+1, committed within 100 ms and at every session end
			h.st.mu.Lock()
			h.st.n++
			h.st.mu.Unlock()
			h.work.Unlock()
		}
	}
}

func (saramaDriver) group(o opts) error {
	cfg := saramaConfig(o)
	// sarama's way to commit each record is MarkMessage plus its auto-commit loop. A
	// synchronous session.Commit() per record would queue behind the Fetch long poll
	// (MaxWaitTime 500 ms) that sarama keeps in flight on the same connection to this
	// one-node cluster, so each commit would take half a second; the marks are flushed
	// on every rebalance and on Close, so nothing read is left uncommitted at a clean stop.
	cfg.Consumer.Offsets.AutoCommit.Enable = true
	cfg.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	cfg.Consumer.Group.Session.Timeout = time.Duration(o.sessionMs) * time.Millisecond
	cfg.Consumer.Group.Heartbeat.Interval = time.Duration(o.heartbeatMs) * time.Millisecond
	cfg.Consumer.Return.Errors = true
	cg, err := sarama.NewConsumerGroup([]string{o.bootstrap}, o.group, cfg)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	st := newStopper(o)
	h := &groupHandler{o: o, st: st, stop: cancel}
	go func() {
		for err := range cg.Errors() {
			// A commit refused by a rebalance lands here: the next owner re-reads.
			logf("consumer group error: %v", err)
		}
	}()
	done := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
			if err := cg.Consume(ctx, []string{o.topic}, h); err != nil && ctx.Err() == nil {
				logf("consume: %v", err)
				time.Sleep(200 * time.Millisecond)
			}
		}
		done <- nil
	}()
	for !st.now() && ctx.Err() == nil {
		time.Sleep(100 * time.Millisecond)
	}
	cancel()
	<-done
	if err := cg.Close(); err != nil { // leaves the group
		logf("close: %v", err)
	}
	st.mu.Lock()
	n := st.n
	st.mu.Unlock()
	emit(map[string]any{"ev": "closed", "n": n})
	return nil
}

func (saramaDriver) admin(op string, o opts) (map[string]any, error) {
	adm, err := sarama.NewClusterAdmin([]string{o.bootstrap}, saramaConfig(o))
	if err != nil {
		return nil, err
	}
	defer adm.Close()
	switch op {
	case "create":
		out := map[string]any{}
		for _, t := range o.topics {
			err := adm.CreateTopic(t, &sarama.TopicDetail{NumPartitions: int32(o.partitions), ReplicationFactor: 1}, false)
			out[t] = map[string]any{"error_code": saramaCode(err), "message": fmt.Sprint(err)}
		}
		return map[string]any{"topics": out}, nil
	case "list":
		res, err := adm.ListTopics()
		if err != nil {
			return nil, err
		}
		names := []string{}
		for name := range res {
			names = append(names, name)
		}
		sort.Strings(names)
		return map[string]any{"topics": names}, nil
	case "describe":
		res, err := adm.DescribeTopics(o.topics)
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for _, t := range res {
			parts := []map[string]any{}
			sort.Slice(t.Partitions, func(i, j int) bool { return t.Partitions[i].ID < t.Partitions[j].ID })
			for _, p := range t.Partitions {
				parts = append(parts, map[string]any{
					"partition": p.ID, "leader": p.Leader, "replicas": p.Replicas,
					"isr": p.Isr, "error_code": int(p.Err),
				})
			}
			out[t.Name] = map[string]any{"error_code": int(t.Err), "partitions": parts}
		}
		return map[string]any{"topics": out}, nil
	case "delete":
		out := map[string]any{}
		for _, t := range o.topics {
			err := adm.DeleteTopic(t)
			out[t] = map[string]any{"error_code": saramaCode(err), "message": fmt.Sprint(err)}
		}
		return map[string]any{"topics": out}, nil
	case "configs":
		out := map[string]any{}
		for _, t := range o.topics {
			entries, err := adm.DescribeConfig(sarama.ConfigResource{Type: sarama.TopicResource, Name: t})
			cfg := map[string]any{}
			for _, e := range entries {
				cfg[e.Name] = map[string]any{"value": e.Value, "source": e.Source.String()}
			}
			out[t] = map[string]any{"error_code": saramaCode(err), "configs": cfg}
		}
		return map[string]any{"topics": out}, nil
	case "list-groups":
		res, err := adm.ListConsumerGroups()
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for name, protocolType := range res {
			out[name] = map[string]any{"protocol_type": protocolType}
		}
		return map[string]any{"groups": out}, nil
	case "describe-groups":
		res, err := adm.DescribeConsumerGroups(o.groups)
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for _, g := range res {
			members := []map[string]any{}
			for id, m := range g.Members {
				assigned := map[string][]int32{}
				if a, err := m.GetMemberAssignment(); err == nil && a != nil {
					assigned = a.Topics
				}
				members = append(members, map[string]any{
					"member_id": id, "client_id": m.ClientId, "assigned": assigned,
				})
			}
			out[g.GroupId] = map[string]any{
				"error_code": int(g.Err), "state": g.State, "protocol_type": g.ProtocolType,
				"protocol": g.Protocol, "members": members,
			}
		}
		return map[string]any{"groups": out}, nil
	case "list-offsets":
		// Client.GetOffset answers the broker's offset as is: -1 for no record at or after
		// the timestamp.
		client, err := sarama.NewClient([]string{o.bootstrap}, saramaConfig(o))
		if err != nil {
			return nil, err
		}
		defer client.Close()
		out := map[string]int64{}
		for _, at := range o.ats {
			off, err := client.GetOffset(o.topic, int32(o.partition), at)
			if err != nil {
				return nil, err
			}
			out[fmt.Sprint(at)] = off
		}
		return map[string]any{"offsets": out}, nil
	case "offsets":
		res, err := adm.ListConsumerGroupOffsets(o.group, nil)
		if err != nil {
			return nil, err
		}
		out := map[string]int64{}
		for _, ps := range res.Blocks {
			for p, b := range ps {
				if b.Err != sarama.ErrNoError {
					return nil, fmt.Errorf("partition %d: %w", p, b.Err)
				}
				out[fmt.Sprint(p)] = b.Offset
			}
		}
		return map[string]any{"offsets": out}, nil
	}
	return nil, fmt.Errorf("unknown admin operation %q", op)
}
