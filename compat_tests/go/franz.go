package main

// The franz-go side (pkg/kgo for producing and consuming, pkg/kadm for admin). Every
// option that differs from franz-go's defaults is set for a reason given beside it; the
// producer stays idempotent unless --idempotence off, because that is franz-go's default.

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

type franz struct{}

func franzCodec(name string) (kgo.CompressionCodec, error) {
	switch name {
	case "none":
		return kgo.NoCompression(), nil
	case "gzip":
		return kgo.GzipCompression(), nil
	case "snappy":
		return kgo.SnappyCompression(), nil
	case "lz4":
		return kgo.Lz4Compression(), nil
	case "zstd":
		return kgo.ZstdCompression(), nil
	}
	return kgo.NoCompression(), fmt.Errorf("unknown codec %q", name)
}

// franzBase: the options of every client, with --spec's TLS and SASL.
func franzBase(o opts) []kgo.Opt {
	out := []kgo.Opt{kgo.SeedBrokers(o.bootstrap), kgo.ClientID("hk-compat-franz-go")}
	sec, err := franzSecurity(o.spec)
	if err != nil {
		fail("security options: %v", err)
	}
	if o.autoCreate {
		out = append(out, kgo.AllowAutoTopicCreation())
	}
	return append(out, sec...)
}

// errCode is the Kafka error code inside err: 0 for nil, -1 when it is not a Kafka error.
func errCode(err error) int {
	if err == nil {
		return 0
	}
	var ke *kerr.Error
	if errors.As(err, &ke) {
		return int(ke.Code)
	}
	return -1
}

func (franz) produce(o opts, recs []rec) (map[string]any, error) {
	codec, err := franzCodec(o.codec)
	if err != nil {
		return nil, err
	}
	kopts := append(franzBase(o),
		kgo.DefaultProduceTopic(o.topic),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerBatchCompression(codec),
		kgo.ProducerLinger(5*time.Millisecond),
		kgo.MaxBufferedRecords(len(recs)+1),
		kgo.RecordDeliveryTimeout(2*time.Minute),
	)
	if o.maxBatch > 0 {
		kopts = append(kopts, kgo.ProducerBatchMaxBytes(int32(o.maxBatch)))
	}
	switch o.acks {
	case "all":
		kopts = append(kopts, kgo.RequiredAcks(kgo.AllISRAcks()))
	case "1":
		kopts = append(kopts, kgo.RequiredAcks(kgo.LeaderAck()), kgo.DisableIdempotentWrite())
	case "0":
		kopts = append(kopts, kgo.RequiredAcks(kgo.NoAck()), kgo.DisableIdempotentWrite())
	}
	if o.idempotence == "off" {
		kopts = append(kopts, kgo.DisableIdempotentWrite())
	}
	cl, err := kgo.NewClient(kopts...)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()

	offsets := make([]int64, len(recs))
	pids := make([]int64, len(recs))
	errs := make([]error, len(recs))
	var wg sync.WaitGroup
	for i, r := range recs {
		kr := &kgo.Record{Key: r.Key, Value: r.Value, Partition: int32(o.partition)}
		for _, h := range r.Headers {
			kr.Headers = append(kr.Headers, kgo.RecordHeader{Key: h.Name, Value: h.Value})
		}
		if r.Timestamp != nil {
			kr.Timestamp = time.UnixMilli(*r.Timestamp)
		}
		wg.Add(1)
		cl.Produce(ctx, kr, func(got *kgo.Record, err error) {
			defer wg.Done()
			offsets[i], pids[i], errs[i] = got.Offset, got.ProducerID, err
		})
	}
	wg.Wait()
	out, err := produceResult(o, offsets, errs, errCode)
	if err != nil || o.allowErrors {
		return out, err
	}
	out["producer_id"] = nil
	if len(pids) > 0 && pids[0] >= 0 {
		out["producer_id"] = pids[0]
	}
	return out, nil
}

func franzRec(r *kgo.Record) rec {
	out := rec{Key: r.Key, Value: r.Value, Offset: r.Offset, Partition: r.Partition}
	ts := r.Timestamp.UnixMilli()
	out.Timestamp = &ts
	for _, h := range r.Headers {
		out.Headers = append(out.Headers, hdr{h.Key, h.Value})
	}
	return out
}

func (franz) consume(o opts) ([]rec, int64, map[string]any, error) {
	cl, err := kgo.NewClient(append(franzBase(o),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{
			o.topic: {int32(o.partition): kgo.NewOffset().At(o.offset)},
		}),
		kgo.FetchMaxPartitionBytes(8<<20),
	)...)
	if err != nil {
		return nil, 0, nil, err
	}
	defer cl.Close()
	var out []rec
	pids := map[int64]bool{}
	poll := func(wait time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		fs := cl.PollFetches(ctx)
		var ferr error
		fs.EachError(func(t string, p int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) && ferr == nil {
				ferr = fmt.Errorf("fetch %s/%d: %w", t, p, err)
			}
		})
		fs.EachRecord(func(r *kgo.Record) {
			out = append(out, franzRec(r))
			pids[r.ProducerID] = true
		})
		return ferr
	}
	c := newClock(o)
	for len(out) < o.count && c.goOn(len(out)) {
		if err := poll(500 * time.Millisecond); err != nil {
			return nil, 0, nil, err
		}
	}
	// Anything past the expected count is a duplicate or a stray: collect it to report.
	if err := poll(300 * time.Millisecond); err != nil {
		return nil, 0, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, o.topic)
	if err != nil {
		return nil, 0, nil, err
	}
	end, found := ends.Lookup(o.topic, int32(o.partition))
	if !found || end.Err != nil {
		return nil, 0, nil, fmt.Errorf("ListOffsets latest: %v", end.Err)
	}
	ids := []int64{}
	for id := range pids {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return out, end.Offset, map[string]any{"producer_ids": ids}, nil
}

func (franz) group(o opts) error {
	var mu sync.Mutex
	owned := map[int32]bool{}
	report := func() {
		parts := []int32{}
		for p := range owned {
			parts = append(parts, p)
		}
		sort.Slice(parts, func(i, j int) bool { return parts[i] < parts[j] })
		emit(map[string]any{"ev": "assigned", "parts": parts, "t": float64(time.Now().UnixNano()) / 1e9})
	}
	drop := func(_ context.Context, _ *kgo.Client, gone map[string][]int32) {
		mu.Lock()
		defer mu.Unlock()
		for _, p := range gone[o.topic] {
			delete(owned, p)
		}
	}
	group := []kgo.Opt{}
	if o.protocol == "consumer" {
		// KIP-848: the broker assigns (its session and heartbeat interval rule too);
		// kgo takes the new protocol only with a sticky or range balancer.
		group = append(group, kgo.ServerSideBalancer(), kgo.Balancers(kgo.CooperativeStickyBalancer()))
	}
	cl, err := kgo.NewClient(append(append(franzBase(o), group...),
		kgo.ConsumerGroup(o.group),
		kgo.ConsumeTopics(o.topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		kgo.SessionTimeout(time.Duration(o.sessionMs)*time.Millisecond),
		kgo.HeartbeatInterval(time.Duration(o.heartbeatMs)*time.Millisecond),
		// franz-go's default balancer is cooperative-sticky: a callback names only the
		// partitions added or taken away, so the worker reports the whole set it owns.
		// franz-go calls OnPartitionsAssigned after every rebalance, even with none new.
		kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, added map[string][]int32) {
			mu.Lock()
			defer mu.Unlock()
			for _, p := range added[o.topic] {
				owned[p] = true
			}
			report()
		}),
		kgo.OnPartitionsRevoked(drop),
		kgo.OnPartitionsLost(drop),
	)...)
	if err != nil {
		return err
	}
	st := newStopper(o)
	n := 0
	for !st.now() {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		fs := cl.PollRecords(ctx, 10)
		cancel()
		fs.EachError(func(t string, p int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) {
				logf("fetch error %s/%d: %v", t, p, err)
			}
		})
		for _, r := range fs.Records() {
			emit(map[string]any{"ev": "rec", "p": r.Partition, "o": r.Offset, "v": string(r.Value)})
			time.Sleep(time.Duration(o.delayMs) * time.Millisecond)
			n++
			st.mu.Lock()
			st.n = n
			st.mu.Unlock()
			cctx, ccancel := context.WithTimeout(context.Background(), 20*time.Second)
			// CommitRecords commits offset+1 of the record, synchronously.
			if err := cl.CommitRecords(cctx, r); err != nil {
				// A rebalance took the partition: its next owner reads from the last commit.
				logf("commit failed: %v", err)
			}
			ccancel()
			if st.now() {
				break
			}
		}
	}
	cl.Close() // leaves the group
	emit(map[string]any{"ev": "closed", "n": n})
	return nil
}

func (franz) admin(op string, o opts) (map[string]any, error) {
	cl, err := kgo.NewClient(franzBase(o)...)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	switch op {
	case "create":
		res, err := adm.CreateTopics(ctx, int32(o.partitions), 1, nil, o.topics...)
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for name, r := range res {
			out[name] = map[string]any{"error_code": errCode(r.Err), "partitions": r.NumPartitions}
		}
		return map[string]any{"topics": out}, nil
	case "list":
		res, err := adm.ListTopics(ctx)
		if err != nil {
			return nil, err
		}
		return map[string]any{"topics": res.Names()}, nil
	case "describe":
		res, err := adm.ListTopics(ctx, o.topics...)
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for name, t := range res {
			parts := []map[string]any{}
			for _, p := range t.Partitions.Sorted() {
				parts = append(parts, map[string]any{
					"partition": p.Partition, "leader": p.Leader, "replicas": p.Replicas,
					"isr": p.ISR, "error_code": errCode(p.Err),
				})
			}
			out[name] = map[string]any{"error_code": errCode(t.Err), "partitions": parts}
		}
		return map[string]any{"topics": out}, nil
	case "delete":
		res, err := adm.DeleteTopics(ctx, o.topics...)
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for name, r := range res {
			out[name] = map[string]any{"error_code": errCode(r.Err)}
		}
		return map[string]any{"topics": out}, nil
	case "configs":
		res, err := adm.DescribeTopicConfigs(ctx, o.topics...)
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for _, rc := range res {
			cfg := map[string]any{}
			for _, c := range rc.Configs {
				cfg[c.Key] = map[string]any{"value": c.Value, "source": c.Source.String()}
			}
			out[rc.Name] = map[string]any{"error_code": errCode(rc.Err), "configs": cfg}
		}
		return map[string]any{"topics": out}, nil
	case "list-groups":
		res, err := adm.ListGroups(ctx)
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for name, g := range res {
			out[name] = map[string]any{"state": g.State, "protocol_type": g.ProtocolType}
		}
		return map[string]any{"groups": out}, nil
	case "describe-groups":
		res, err := adm.DescribeGroups(ctx, o.groups...)
		if err != nil {
			return nil, err
		}
		out := map[string]any{}
		for name, g := range res {
			members := []map[string]any{}
			for _, m := range g.Members {
				assigned := map[string][]int32{}
				if ca, ok := m.Assigned.AsConsumer(); ok {
					for _, t := range ca.Topics {
						assigned[t.Topic] = append(assigned[t.Topic], t.Partitions...)
					}
				}
				members = append(members, map[string]any{
					"member_id": m.MemberID, "client_id": m.ClientID, "assigned": assigned,
				})
			}
			out[name] = map[string]any{
				"error_code": errCode(g.Err), "state": g.State, "protocol_type": g.ProtocolType,
				"protocol": g.Protocol, "members": members,
			}
		}
		return map[string]any{"groups": out}, nil
	case "list-offsets":
		// kadm's documented mapping: a timestamp past the last record lists the end offset.
		out := map[string]int64{}
		for _, at := range o.ats {
			var res kadm.ListedOffsets
			switch at {
			case -1:
				res, err = adm.ListEndOffsets(ctx, o.topic)
			case -2:
				res, err = adm.ListStartOffsets(ctx, o.topic)
			default:
				res, err = adm.ListOffsetsAfterMilli(ctx, at, o.topic)
			}
			if err != nil {
				return nil, err
			}
			l, ok := res.Lookup(o.topic, int32(o.partition))
			if !ok {
				return nil, fmt.Errorf("no answer for %s-%d", o.topic, o.partition)
			}
			if l.Err != nil {
				return nil, l.Err
			}
			out[fmt.Sprint(at)] = l.Offset
		}
		return map[string]any{"offsets": out}, nil
	case "offsets":
		res, err := adm.FetchOffsets(ctx, o.group)
		if err != nil {
			return nil, err
		}
		out := map[string]int64{}
		for _, ps := range res {
			for p, r := range ps {
				if r.Err != nil {
					return nil, fmt.Errorf("partition %d: %w", p, r.Err)
				}
				out[fmt.Sprint(p)] = r.At
			}
		}
		return map[string]any{"offsets": out}, nil
	}
	return nil, fmt.Errorf("unknown admin operation %q", op)
}
