// Command hkgo drives the Go Kafka clients (franz-go and sarama) for the compatibility tests.
//
// It owns only the Go side of the exchange that compat_tests/clients.py and
// compat_tests/test_go_clients.py drive: every test runs it as a child process with a
// timeout, hands it records as JSON lines (the format of compat_tests/records.py) and reads
// one JSON summary from the last line of its stdout. Usage:
//
//	hkgo CLIENT produce  --bootstrap B --topic T --infile F [--codec C] [--idempotence on|off]
//	hkgo CLIENT consume  --bootstrap B --topic T --outfile F --count N [--offset O]
//	hkgo CLIENT group    --bootstrap B --topic T --group G [--stop-file F] [--max-records N] [--protocol consumer]
//	hkgo CLIENT admin OP --bootstrap B [--topic T ...] [--group G ...] [--partitions N]
//	hkgo CLIENT admin list-offsets --bootstrap B --topic T [--partition P] --at TS ...
//	    (ListOffsets: TS -1 latest, -2 earliest, or a timestamp; {"offsets": {TS: offset}})
//
// Every action takes --spec JSON for TLS and SASL (security.go) and --auto-create (ask the
// broker to create a missing topic when the client looks it up).
// CLIENT is franz-go or sarama. A failure prints its cause on stderr and exits 1.
package main

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// rec is one record as the Python side writes and reads it (compat_tests/records.py).
type rec struct {
	Key       []byte
	Value     []byte
	Headers   []hdr
	Timestamp *int64
	Offset    int64
	Partition int32
}

type hdr struct {
	Name  string
	Value []byte
}

func b64(b []byte) *string {
	if b == nil {
		return nil
	}
	s := base64.StdEncoding.EncodeToString(b)
	return &s
}

func unb64(s *string) ([]byte, error) {
	if s == nil {
		return nil, nil
	}
	// A non-nil empty slice: "empty" and "null" are different records.
	b, err := base64.StdEncoding.DecodeString(*s)
	if b == nil {
		b = []byte{}
	}
	return b, err
}

type jsonRec struct {
	K  *string      `json:"k"`
	V  *string      `json:"v"`
	H  [][2]*string `json:"h"`
	TS *int64       `json:"ts"`
	O  *int64       `json:"o,omitempty"`
}

func readRecords(path string) ([]rec, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	var out []rec
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var j jsonRec
		if err := json.Unmarshal([]byte(line), &j); err != nil {
			return nil, fmt.Errorf("record %d: %w", len(out), err)
		}
		r := rec{Timestamp: j.TS}
		if r.Key, err = unb64(j.K); err != nil {
			return nil, err
		}
		if r.Value, err = unb64(j.V); err != nil {
			return nil, err
		}
		for _, h := range j.H {
			if h[0] == nil {
				return nil, fmt.Errorf("record %d: header without a name", len(out))
			}
			v, err := unb64(h[1])
			if err != nil {
				return nil, err
			}
			r.Headers = append(r.Headers, hdr{*h[0], v})
		}
		out = append(out, r)
	}
	return out, sc.Err()
}

func writeRecords(path string, recs []rec) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	for _, r := range recs {
		o := r.Offset
		j := jsonRec{K: b64(r.Key), V: b64(r.Value), TS: r.Timestamp, O: &o, H: [][2]*string{}}
		for _, h := range r.Headers {
			name := h.Name
			j.H = append(j.H, [2]*string{&name, b64(h.Value)})
		}
		line, err := json.Marshal(j)
		if err != nil {
			return err
		}
		w.Write(line)
		w.WriteByte('\n')
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return f.Close()
}

// emitMu keeps the group worker's event lines whole when several goroutines report.
var emitMu sync.Mutex

// emit prints one JSON line on stdout (the group worker's event stream and every summary).
func emit(v any) {
	line, err := json.Marshal(v)
	if err != nil {
		fail("json: %v", err)
	}
	emitMu.Lock()
	defer emitMu.Unlock()
	os.Stdout.Write(append(line, '\n'))
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "hkgo: "+format+"\n", args...)
	os.Exit(1)
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05.000")+" "+format+"\n", args...)
}

// checkOffsets: the producer's own acks must be consecutive offsets (no gap, no reorder).
func checkOffsets(offsets []int64) map[string]any {
	for i := 1; i < len(offsets); i++ {
		if offsets[i] != offsets[i-1]+1 {
			fail("producer acks not consecutive: ... %d, %d ...", offsets[i-1], offsets[i])
		}
	}
	out := map[string]any{"n": len(offsets), "offsets": []int64{}}
	if len(offsets) > 0 {
		out["offsets"] = []int64{offsets[0], offsets[len(offsets)-1]}
	}
	return out
}

// produceResult turns the per-record outcome of a produce into the JSON the tests read.
// With allowErrors, failures are counted by Kafka error code (code maps a client's error
// to one); without, the first failure fails the run and the acks must be consecutive.
func produceResult(o opts, offsets []int64, errs []error, code func(error) int) (map[string]any, error) {
	codes := map[string]int{}
	var ok []int64
	for i, err := range errs {
		if err != nil {
			if !o.allowErrors {
				return nil, fmt.Errorf("record %d: %w", i, err)
			}
			codes[fmt.Sprint(code(err))]++
			continue
		}
		ok = append(ok, offsets[i])
	}
	if o.allowErrors {
		return map[string]any{"n": len(ok), "error_codes": codes}, nil
	}
	return checkOffsets(ok), nil
}

type multi []string

func (m *multi) String() string     { return strings.Join(*m, ",") }
func (m *multi) Set(s string) error { *m = append(*m, s); return nil }

// opts are the flags of every subcommand; each uses the ones it needs.
type opts struct {
	bootstrap   string
	topic       string
	topics      multi
	groups      multi
	ats         []int64
	group       string
	partition   int
	partitions  int
	codec       string
	acks        string
	idempotence string
	infile      string
	outfile     string
	count       int
	offset      int64
	timeout     time.Duration
	idle        time.Duration
	maxBatch    int
	allowErrors bool
	sessionMs   int
	heartbeatMs int
	delayMs     int
	maxRecords  int
	stopFile    string
	protocol    string
	spec        *secSpec
	autoCreate  bool
}

func parse(args []string) opts {
	var o opts
	fs := flag.NewFlagSet("hkgo", flag.ExitOnError)
	fs.StringVar(&o.bootstrap, "bootstrap", "", "host:port")
	fs.Var(&o.topics, "topic", "topic (repeatable for admin)")
	fs.Var(&o.groups, "group", "group (repeatable for admin)")
	var ats multi
	fs.Var(&ats, "at", "ListOffsets timestamp (repeatable for admin list-offsets)")
	fs.IntVar(&o.partition, "partition", 0, "")
	fs.IntVar(&o.partitions, "partitions", 1, "partitions for admin create")
	fs.StringVar(&o.codec, "codec", "none", "none|gzip|snappy|lz4|zstd")
	fs.StringVar(&o.acks, "acks", "all", "all|1|0")
	fs.StringVar(&o.idempotence, "idempotence", "", "on|off (default: the client's own)")
	fs.StringVar(&o.infile, "infile", "", "")
	fs.StringVar(&o.outfile, "outfile", "", "")
	fs.IntVar(&o.count, "count", 0, "")
	fs.Int64Var(&o.offset, "offset", 0, "")
	timeout := fs.Float64("timeout", 120, "seconds")
	idle := fs.Float64("idle", 20, "give up consuming after this long without a new record")
	fs.IntVar(&o.maxBatch, "max-batch-bytes", 0, "client-side batch/message size limit (0: the client's default)")
	fs.BoolVar(&o.allowErrors, "allow-errors", false, "report produce errors instead of failing")
	fs.IntVar(&o.sessionMs, "session-ms", 6000, "")
	fs.IntVar(&o.heartbeatMs, "heartbeat-ms", 500, "")
	fs.IntVar(&o.delayMs, "delay-ms", 0, "")
	fs.IntVar(&o.maxRecords, "max-records", 0, "")
	fs.StringVar(&o.stopFile, "stop-file", "", "")
	fs.StringVar(&o.protocol, "protocol", "classic", "group protocol: classic or consumer (KIP-848, franz-go only)")
	spec := fs.String("spec", "", "TLS/SASL as JSON: protocol, mechanism, user, password, ca, cert, key")
	fs.BoolVar(&o.autoCreate, "auto-create", false, "let metadata requests create a missing topic")
	if err := fs.Parse(args); err != nil {
		fail("%v", err)
	}
	var err error
	if o.spec, err = parseSpec(*spec); err != nil {
		fail("%v", err)
	}
	if o.bootstrap == "" {
		fail("--bootstrap is required")
	}
	for _, a := range ats {
		v, err := strconv.ParseInt(a, 10, 64)
		if err != nil {
			fail("--at %q: %v", a, err)
		}
		o.ats = append(o.ats, v)
	}
	if len(o.topics) > 0 {
		o.topic = o.topics[0]
	}
	if len(o.groups) > 0 {
		o.group = o.groups[0]
	}
	o.timeout = time.Duration(*timeout * float64(time.Second))
	o.idle = time.Duration(*idle * float64(time.Second))
	return o
}

// stopper decides when a group member stops: a stop file, a record budget or the timeout.
type stopper struct {
	o        opts
	deadline time.Time
	mu       sync.Mutex
	n        int
}

func newStopper(o opts) *stopper { return &stopper{o: o, deadline: time.Now().Add(o.timeout)} }

func (s *stopper) now() bool {
	s.mu.Lock()
	n := s.n
	s.mu.Unlock()
	if s.o.stopFile != "" {
		if _, err := os.Stat(s.o.stopFile); err == nil {
			return true
		}
	}
	return (s.o.maxRecords > 0 && n >= s.o.maxRecords) || time.Now().After(s.deadline)
}

// clock stops a consume loop at its timeout or after --idle without a new record.
type clock struct {
	deadline   time.Time
	idle       time.Duration
	lastN      int
	lastChange time.Time
}

func newClock(o opts) *clock {
	now := time.Now()
	return &clock{deadline: now.Add(o.timeout), idle: o.idle, lastN: -1, lastChange: now}
}

func (c *clock) goOn(n int) bool {
	now := time.Now()
	if n != c.lastN {
		c.lastN, c.lastChange = n, now
	}
	return now.Before(c.deadline) && now.Sub(c.lastChange) < c.idle
}

type driver interface {
	produce(o opts, recs []rec) (map[string]any, error)
	consume(o opts) ([]rec, int64, map[string]any, error)
	group(o opts) error
	admin(op string, o opts) (map[string]any, error)
}

var errUsage = errors.New("usage: hkgo franz-go|sarama produce|consume|group|admin [OP] --bootstrap B ...")

func main() {
	if len(os.Args) < 3 {
		fail("%v", errUsage)
	}
	var d driver
	switch os.Args[1] {
	case "franz-go":
		d = franz{}
	case "sarama":
		d = saramaDriver{}
	default:
		fail("unknown client %q; %v", os.Args[1], errUsage)
	}
	action, rest := os.Args[2], os.Args[3:]
	switch action {
	case "produce":
		o := parse(rest)
		recs, err := readRecords(o.infile)
		if err != nil {
			fail("reading %s: %v", o.infile, err)
		}
		summary, err := d.produce(o, recs)
		if err != nil {
			fail("produce: %v", err)
		}
		emit(summary)
	case "consume":
		o := parse(rest)
		recs, hwm, extra, err := d.consume(o)
		if err != nil {
			fail("consume: %v", err)
		}
		if err := writeRecords(o.outfile, recs); err != nil {
			fail("writing %s: %v", o.outfile, err)
		}
		summary := map[string]any{"n": len(recs), "high_watermark": hwm}
		for k, v := range extra {
			summary[k] = v
		}
		emit(summary)
	case "group":
		if err := d.group(parse(rest)); err != nil {
			fail("group: %v", err)
		}
	case "admin":
		if len(rest) < 1 {
			fail("admin needs an operation")
		}
		out, err := d.admin(rest[0], parse(rest[1:]))
		if err != nil {
			fail("admin %s: %v", rest[0], err)
		}
		emit(out)
	default:
		fail("unknown action %q; %v", action, errUsage)
	}
}
