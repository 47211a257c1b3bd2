package main

// TLS and SASL for both Go clients, from the security tests' client-neutral spec
// (compat_tests/test_security.py `spec`, the same JSON the kafkajs worker takes):
//
//	{"protocol": "PLAINTEXT|SSL|SASL_PLAINTEXT|SASL_SSL", "mechanism": "PLAIN|SCRAM-SHA-256|SCRAM-SHA-512",
//	 "user": U, "password": P, "ca": CA.pem, "cert": client.pem, "key": client-key.pem}
//
// franz-go does TLS with kgo.DialTLSConfig and SASL with its own pkg/sasl/plain and
// pkg/sasl/scram. sarama does TLS and the SASL handshake itself (Config.Net.TLS,
// Config.Net.SASL) but leaves the SCRAM computation to a client the caller supplies:
// xdg-go/scram, as in sarama's own SCRAM example.

import (
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"os"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	franzscram "github.com/twmb/franz-go/pkg/sasl/scram"
	"github.com/xdg-go/scram"
)

// secSpec is the --spec JSON; its other keys (bootstrap, tag) are the Python side's.
type secSpec struct {
	Protocol  string `json:"protocol"`
	Mechanism string `json:"mechanism"`
	User      string `json:"user"`
	Password  string `json:"password"`
	CA        string `json:"ca"`
	Cert      string `json:"cert"`
	Key       string `json:"key"`
}

func parseSpec(s string) (*secSpec, error) {
	if s == "" {
		return nil, nil
	}
	var sp secSpec
	if err := json.Unmarshal([]byte(s), &sp); err != nil {
		return nil, fmt.Errorf("--spec: %w", err)
	}
	switch sp.Protocol {
	case "", "PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL":
	default:
		return nil, fmt.Errorf("--spec: unknown protocol %q", sp.Protocol)
	}
	if sp.sasl() {
		switch sp.Mechanism {
		case "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512":
		default:
			return nil, fmt.Errorf("--spec: unsupported SASL mechanism %q", sp.Mechanism)
		}
	}
	return &sp, nil
}

func (s *secSpec) tls() bool { return s != nil && (s.Protocol == "SSL" || s.Protocol == "SASL_SSL") }
func (s *secSpec) sasl() bool {
	return s != nil && (s.Protocol == "SASL_PLAINTEXT" || s.Protocol == "SASL_SSL")
}

// tlsConfig trusts only the spec's CA (not the system roots) and, for mTLS, presents the
// client certificate. The broker's certificate is checked against the host dialled.
func (s *secSpec) tlsConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if s.CA != "" {
		pem, err := os.ReadFile(s.CA)
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("no certificate in %s", s.CA)
		}
	}
	if s.Cert != "" || s.Key != "" {
		pair, err := tls.LoadX509KeyPair(s.Cert, s.Key)
		if err != nil {
			return nil, err
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// franzSecurity: the kgo options for the spec (none for PLAINTEXT or no spec).
func franzSecurity(s *secSpec) ([]kgo.Opt, error) {
	var out []kgo.Opt
	if s.tls() {
		cfg, err := s.tlsConfig()
		if err != nil {
			return nil, err
		}
		out = append(out, kgo.DialTLSConfig(cfg))
	}
	if s.sasl() {
		var m sasl.Mechanism
		switch s.Mechanism {
		case "PLAIN":
			m = plain.Auth{User: s.User, Pass: s.Password}.AsMechanism()
		case "SCRAM-SHA-256":
			m = franzscram.Auth{User: s.User, Pass: s.Password}.AsSha256Mechanism()
		case "SCRAM-SHA-512":
			m = franzscram.Auth{User: s.User, Pass: s.Password}.AsSha512Mechanism()
		}
		out = append(out, kgo.SASL(m))
	}
	return out, nil
}

// saramaSecurity sets cfg.Net.TLS and cfg.Net.SASL for the spec.
func saramaSecurity(cfg *sarama.Config, s *secSpec) error {
	if s.tls() {
		tc, err := s.tlsConfig()
		if err != nil {
			return err
		}
		cfg.Net.TLS.Enable = true
		cfg.Net.TLS.Config = tc
	}
	if s.sasl() {
		cfg.Net.SASL.Enable = true
		cfg.Net.SASL.Handshake = true
		cfg.Net.SASL.User = s.User
		cfg.Net.SASL.Password = s.Password
		switch s.Mechanism {
		case "PLAIN":
			cfg.Net.SASL.Mechanism = sarama.SASLTypePlaintext
		case "SCRAM-SHA-256":
			cfg.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA256
			cfg.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &xdgSCRAM{hash: scram.HashGeneratorFcn(sha256.New)} }
		case "SCRAM-SHA-512":
			cfg.Net.SASL.Mechanism = sarama.SASLTypeSCRAMSHA512
			cfg.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &xdgSCRAM{hash: scram.HashGeneratorFcn(sha512.New)} }
		}
	}
	return nil
}

// xdgSCRAM is sarama's SCRAMClient over xdg-go/scram (sarama's examples/sasl_scram_client).
type xdgSCRAM struct {
	hash scram.HashGeneratorFcn
	conv *scram.ClientConversation
}

func (x *xdgSCRAM) Begin(user, password, authzID string) error {
	c, err := x.hash.NewClient(user, password, authzID)
	if err != nil {
		return err
	}
	x.conv = c.NewConversation()
	return nil
}

func (x *xdgSCRAM) Step(challenge string) (string, error) { return x.conv.Step(challenge) }
func (x *xdgSCRAM) Done() bool                            { return x.conv.Done() }
