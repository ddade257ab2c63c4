// Unit tests of what main.go adds to grpc-gateway, and of the build's proto
// rewrite; tests/integration/test_gateway_go.py runs them in CI.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/golang/protobuf/proto"
	"github.com/golang/protobuf/ptypes"
	"github.com/grpc-ecosystem/grpc-gateway/runtime"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	llmmeshv1 "llmmesh/gen/llmmeshv1"
)

func TestIncomingHeaderKeepsRouterInternalMetadataOut(t *testing.T) {
	cases := []struct {
		header  string
		want    string
		forward bool
	}{
		{"Grpc-Metadata-Trace-Id", "trace-id", true},
		{"grpc-metadata-x-request-id", "x-request-id", true},
		// Only the router sets the tenant and user: a REST client must not.
		{"Grpc-Metadata-X-Llmmesh-Tenant", "", false},
		{"Grpc-Metadata-X-Llmmesh-User", "", false},
		// The runtime forwards Authorization itself; no second copy.
		{"Grpc-Metadata-Authorization", "", false},
		{"Authorization", "", false},
		{"Cookie", "", false},
		{"User-Agent", "", false},
	}
	for _, c := range cases {
		got, ok := incomingHeader(c.header)
		if ok != c.forward || got != c.want {
			t.Errorf("incomingHeader(%q) = %q, %v; want %q, %v", c.header, got, ok, c.want, c.forward)
		}
	}
}

func TestOutgoingHeaderDropsTransportMetadata(t *testing.T) {
	for key, want := range map[string]string{"x-served-by": "Grpc-Metadata-x-served-by", "content-type": "", "grpc-accept-encoding": ""} {
		got, ok := outgoingHeader(key)
		if got != want || ok != (want != "") {
			t.Errorf("outgoingHeader(%q) = %q, %v; want %q", key, got, ok, want)
		}
	}
}

func TestLimitBodyRefusesOversizedBodiesBeforeTheHandler(t *testing.T) {
	reached := 0
	handler := limitBody(16, time.Second, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached++
		body, _ := io.ReadAll(r.Body)
		_, _ = w.Write(body)
	}))
	for _, c := range []struct {
		name    string
		body    string
		chunked bool
		status  int
	}{
		{"fits", `{"a":"0123456"}`, false, http.StatusOK},
		{"exactly the limit", strings.Repeat("x", 16), false, http.StatusOK},
		{"declared too large", strings.Repeat("x", 17), false, http.StatusRequestEntityTooLarge},
		{"chunked too large", strings.Repeat("x", 17), true, http.StatusRequestEntityTooLarge},
	} {
		req := httptest.NewRequest(http.MethodPost, "/v1/complete", strings.NewReader(c.body))
		if c.chunked {
			req.ContentLength = -1
		}
		rec := httptest.NewRecorder()
		handler.ServeHTTP(rec, req)
		if rec.Code != c.status {
			t.Errorf("%s: status %d, want %d", c.name, rec.Code, c.status)
		}
		if c.status == http.StatusOK && rec.Body.String() != c.body {
			t.Errorf("%s: handler read %q, want %q", c.name, rec.Body.String(), c.body)
		}
	}
	if reached != 2 {
		t.Errorf("handler reached %d times, want 2 (oversized bodies must stop at the limit)", reached)
	}
}

func TestStrictJSONRefusesASecondValueAfterTheBody(t *testing.T) {
	m := strictJSON{&runtime.JSONPb{OrigName: true}}
	var req llmmeshv1.ChatRequest
	err := m.NewDecoder(strings.NewReader(`{"prompt": "hi"} {"garbage": 1}`)).Decode(&req)
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "more than one JSON value") {
		t.Fatalf("trailing value: got %v, want INVALID_ARGUMENT", err)
	}
	if err := m.NewDecoder(strings.NewReader("{\"prompt\": \"hi\"}\n")).Decode(&req); err != nil {
		t.Fatalf("one value and a newline: %v", err)
	}
}

func TestPlainMethodsIgnoreAMethodOverrideAndAFormContentType(t *testing.T) {
	var seen *http.Request
	handler := plainMethods(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { seen = r }))
	req := httptest.NewRequest(http.MethodPost, "/v1/tasks/abc", strings.NewReader(""))
	req.Header.Set("X-HTTP-Method-Override", "DELETE")
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	handler.ServeHTTP(httptest.NewRecorder(), req)
	if seen.Header.Get("X-HTTP-Method-Override") != "" || seen.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("headers reaching the runtime: %v", seen.Header)
	}
}

func TestABodySentTooSlowlyIsCutOffWith408(t *testing.T) {
	handler := limitBody(1<<20, 300*time.Millisecond, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran for a body that never came")
	}))
	server := httptest.NewUnstartedServer(handler)
	server.Config.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		return context.WithValue(ctx, connKey{}, c)
	}
	server.Start()
	defer server.Close()
	conn, err := net.Dial("tcp", server.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// All but the last byte of the body, then nothing.
	_, _ = fmt.Fprintf(conn, "POST /v1/complete HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n123456789")
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	reply, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(reply), "HTTP/1.1 408") {
		t.Fatalf("reply: %q, want 408", reply)
	}
}

func TestStrictJSONRefusesUnknownFieldsAndKeepsExplicitZeros(t *testing.T) {
	m := strictJSON{&runtime.JSONPb{OrigName: true}}

	var typo llmmeshv1.ChatRequest
	err := m.NewDecoder(strings.NewReader(`{"sampling": {"max_token": 4}}`)).Decode(&typo)
	if err == nil || !strings.Contains(err.Error(), "max_token") {
		t.Fatalf("unknown field: got %v, want an error naming max_token", err)
	}

	var req llmmeshv1.ChatRequest
	body := `{"messages": [{"role": "user", "content": "hi"}], "sampling": {"temperature": 0, "max_tokens": 8}}`
	if err := m.NewDecoder(strings.NewReader(body)).Decode(&req); err != nil {
		t.Fatalf("decode: %v", err)
	}
	// proto3 `optional` became a oneof in the Go build: an explicit 0 is set,
	// so it is on the wire and the router sees greedy decoding, not its default.
	if req.GetSampling().GetXTemperature() == nil {
		t.Fatal("explicit temperature 0 lost its presence")
	}
	wire, err := proto.Marshal(req.GetSampling())
	if err != nil {
		t.Fatal(err)
	}
	var plain llmmeshv1.SamplingParams
	if err := proto.Unmarshal(wire, &plain); err != nil || plain.GetXTemperature() == nil || plain.GetMaxTokens() != 8 {
		t.Fatalf("wire round trip lost fields: %v %v", &plain, err)
	}
}

func TestHTTPErrorMapsCodesAndAddsRetryAfter(t *testing.T) {
	delay := ptypes.DurationProto(1500 * time.Millisecond)
	limited, err := status.New(codes.ResourceExhausted, "rate limit exceeded").WithDetails(&errdetails.RetryInfo{RetryDelay: delay})
	if err != nil {
		t.Fatal(err)
	}
	mux := runtime.NewServeMux()
	marshaler := &runtime.JSONPb{OrigName: true}
	for _, c := range []struct {
		err        error
		status     int
		retryAfter string
	}{
		{limited.Err(), http.StatusTooManyRequests, "2"},
		{status.Error(codes.Unauthenticated, "missing API key"), http.StatusUnauthorized, ""},
		{status.Error(codes.InvalidArgument, "temperature: must be >= 0"), http.StatusBadRequest, ""},
		{status.Error(codes.Unavailable, "no replica"), http.StatusServiceUnavailable, ""},
		{status.Error(codes.DeadlineExceeded, "deadline"), http.StatusGatewayTimeout, ""},
	} {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/v1/complete", nil)
		httpError(context.Background(), mux, marshaler, rec, req, c.err)
		if rec.Code != c.status || rec.Header().Get("Retry-After") != c.retryAfter {
			t.Errorf("%v: got %d Retry-After %q; want %d %q", c.err, rec.Code, rec.Header().Get("Retry-After"), c.status, c.retryAfter)
		}
		var body struct {
			Message string `json:"message"`
			Code    int    `json:"code"`
		}
		if err := json.NewDecoder(bytes.NewReader(rec.Body.Bytes())).Decode(&body); err != nil {
			t.Fatalf("%v: body %q is not JSON: %v", c.err, rec.Body.String(), err)
		}
		if body.Message != status.Convert(c.err).Message() || body.Code != int(status.Code(c.err)) {
			t.Errorf("%v: body %+v does not carry the gRPC status", c.err, body)
		}
	}
}

func TestRoutingErrorsAreJSON(t *testing.T) {
	rec := httptest.NewRecorder()
	routingError(rec, nil, "Not Found", http.StatusNotFound)
	var body map[string]interface{}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != http.StatusNotFound || body["code"] != float64(codes.NotFound) {
		t.Fatalf("got %d %q (%v)", rec.Code, rec.Body.String(), err)
	}
}
