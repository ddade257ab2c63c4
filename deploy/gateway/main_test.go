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
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
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
	// A plain error: the generated handler makes it INVALID_ARGUMENT, with this text as the message.
	if err == nil || err.Error() != "the request body holds more than one JSON value" {
		t.Fatalf("trailing value: got %v", err)
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
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != http.StatusNotFound || body["code"] != float64(codes.NotFound) || body["details"] == nil {
		t.Fatalf("got %d %q (%v)", rec.Code, rec.Body.String(), err)
	}
}

// fakeRouter is the router's gRPC API, each RPC the test needs answered by a func.
type fakeRouter struct {
	llmmeshv1.UnimplementedRouterServer
	calls    int
	complete func(context.Context, *llmmeshv1.ChatRequest) (*llmmeshv1.CompleteResponse, error)
	stream   func(*llmmeshv1.ChatRequest, llmmeshv1.Router_ChatStreamServer) error
}

func (f *fakeRouter) Complete(ctx context.Context, req *llmmeshv1.ChatRequest) (*llmmeshv1.CompleteResponse, error) {
	f.calls++
	if f.complete == nil {
		return &llmmeshv1.CompleteResponse{Text: "ok"}, nil
	}
	return f.complete(ctx, req)
}

func (f *fakeRouter) ChatStream(req *llmmeshv1.ChatRequest, srv llmmeshv1.Router_ChatStreamServer) error {
	f.calls++
	return f.stream(req, srv)
}

// serveGateway runs the gateway's whole handler (newHandler) in front of router, over real
// gRPC and real HTTP, and returns its base URL: what a client sees, byte for byte.
func serveGateway(t *testing.T, router llmmeshv1.RouterServer) string {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	grpcServer := grpc.NewServer()
	llmmeshv1.RegisterRouterServer(grpcServer, router)
	go func() { _ = grpcServer.Serve(listener) }()
	t.Cleanup(grpcServer.Stop)
	conn, err := grpc.Dial(listener.Addr().String(), grpc.WithInsecure())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	handler, err := newHandler(config{maxBodyBytes: 1 << 20, readBodyTimeout: 5 * time.Second, healthTimeout: time.Second}, conn)
	if err != nil {
		t.Fatal(err)
	}
	server := httptest.NewServer(handler)
	t.Cleanup(server.Close)
	return server.URL
}

type reply struct {
	status  int
	header  http.Header
	trailer http.Header
	body    []byte
}

func post(t *testing.T, url, body string, header map[string]string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{resp.StatusCode, resp.Header, resp.Trailer, data}
}

// errorBody is the gateway's one error shape (httpError, writeJSONError), strictly: a field
// more or less fails the decode.
type errorBody struct {
	Error   string             `json:"error"`
	Message string             `json:"message"`
	Code    int                `json:"code"`
	Details *[]json.RawMessage `json:"details"`
}

func decodeError(t *testing.T, r reply) errorBody {
	t.Helper()
	var body errorBody
	d := json.NewDecoder(bytes.NewReader(r.body))
	d.DisallowUnknownFields()
	if err := d.Decode(&body); err != nil || body.Message == "" || body.Error != body.Message || body.Details == nil {
		t.Fatalf("status %d: body %q is not the gateway's error shape (%v)", r.status, r.body, err)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("error Content-Type %q", ct)
	}
	return body
}

func TestAFieldOfTheWrongTypeIsA400NamingItsPath(t *testing.T) {
	router := &fakeRouter{}
	url := serveGateway(t, router) + "/v1/complete"
	for _, c := range []struct{ body, message string }{
		{`{"messages": 5}`, "messages: invalid value 5, want a JSON array, each item a JSON object (llmmesh.v1.ChatMessage)"},
		{`{"sampling": {"max_tokens": "x"}}`, `sampling.max_tokens: invalid value "x", want an integer`},
		{`{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 7}]}`, "messages[1].content: invalid value 7, want a string"},
		// Cut at 40 bytes, back to where a character starts: byte 40 is the middle of an é.
		{`{"sampling": {"temperature": "` + strings.Repeat("é", 30) + `"}}`, `sampling.temperature: invalid value "` + strings.Repeat("é", 19) + `…, want a number`},
		{`{"messages": [{"role": "user", "content": "hi"}, "hi"]}`, `messages[1]: invalid value "hi", want a JSON object (llmmesh.v1.ChatMessage)`},
		{`{"model": "m", "cache": {"mode": ["` + strings.Repeat("x", 60) + `"]}}`, `cache.mode: invalid value ["` + strings.Repeat("x", 38) + `…, want an enum value's name`},
		{`[{"messages": []}]`, `the request body must be a JSON object (llmmesh.v1.ChatRequest), not [{"messages": []}]`},
		{`{"sampling": {"_max_tokens": 4}}`, "sampling._max_tokens: unknown field (llmmesh.v1.SamplingParams has no such field)"},
		{`{"sampling": {"temperature": 0, "max_token": 4}}`, "sampling.max_token: unknown field (llmmesh.v1.SamplingParams has no such field)"},
	} {
		r := post(t, url, c.body, nil)
		body := decodeError(t, r)
		if r.status != http.StatusBadRequest || body.Code != int(codes.InvalidArgument) || body.Message != c.message {
			t.Errorf("%s: got %d %q; want 400 %q", c.body, r.status, body.Message, c.message)
		}
	}
	if router.calls != 0 {
		t.Errorf("the router was called %d times for bodies the gateway refused", router.calls)
	}
	if r := post(t, url, `{"messages": [{"role": "user", "content": "hi"}], "sampling": {"maxTokens": 4}}`, nil); r.status != http.StatusOK {
		t.Errorf("a good body (JSON names): %d %s", r.status, r.body)
	}
}

func TestErrorsCarryNoGrpcTrailers(t *testing.T) {
	router := &fakeRouter{complete: func(ctx context.Context, _ *llmmeshv1.ChatRequest) (*llmmeshv1.CompleteResponse, error) {
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-debug", "1"))
		return nil, status.Error(codes.Unauthenticated, "missing API key")
	}}
	r := post(t, serveGateway(t, router)+"/v1/complete", `{}`, nil)
	if r.status != http.StatusUnauthorized || decodeError(t, r).Code != int(codes.Unauthenticated) {
		t.Fatalf("got %d %s", r.status, r.body)
	}
	// A trailers-only gRPC error brought the transport's content-type along as a trailer.
	for name := range r.header {
		if name == "Trailer" || strings.HasPrefix(name, "Grpc-Trailer-") {
			t.Errorf("header %s: %q", name, r.header[name])
		}
	}
	if len(r.trailer) != 0 {
		t.Errorf("HTTP trailers: %v", r.trailer)
	}
}

func TestAMalformedOrOutOfRangeGrpcTimeoutIsA400NamingTheHeader(t *testing.T) {
	router := &fakeRouter{stream: func(_ *llmmeshv1.ChatRequest, srv llmmeshv1.Router_ChatStreamServer) error { return nil }}
	base := serveGateway(t, router)
	for _, bad := range []string{"-5S", "0S", "99999999H", "100000000S", "+5S", "5", "5x", "1.5S", "5 S"} {
		for _, path := range []string{"/v1/complete", chatStreamPath} {
			r := post(t, base+path, `{}`, map[string]string{"Grpc-Timeout": bad})
			body := decodeError(t, r)
			if r.status != http.StatusBadRequest || body.Code != int(codes.InvalidArgument) || !strings.HasPrefix(body.Message, "Grpc-Timeout: ") {
				t.Errorf("%s Grpc-Timeout %q: got %d %q; want 400 naming Grpc-Timeout", path, bad, r.status, body.Message)
			}
		}
	}
	if router.calls != 0 {
		t.Errorf("the router was called %d times with a bad deadline", router.calls)
	}
	for _, good := range []string{"500m", "30S", "1M", "99999999M", "2562047H"} {
		if r := post(t, base+"/v1/complete", `{}`, map[string]string{"Grpc-Timeout": good}); r.status != http.StatusOK {
			t.Errorf("Grpc-Timeout %q: %d %s", good, r.status, r.body)
		}
	}
	// Valid, and gone before the call starts: the deadline's 504, not a bad header's 400.
	if r := post(t, base+"/v1/complete", `{}`, map[string]string{"Grpc-Timeout": "1n"}); r.status != http.StatusGatewayTimeout {
		t.Errorf("Grpc-Timeout 1n: %d %s", r.status, r.body)
	}
}

func delta(seq uint64, text string) *llmmeshv1.ChatResponse {
	return &llmmeshv1.ChatResponse{Seq: seq, Event: &llmmeshv1.ChatResponse_Delta{Delta: &llmmeshv1.TokenDelta{Text: text}}}
}

func TestEveryLineOfAStreamEndsWithANewlineTheErrorLineToo(t *testing.T) {
	router := &fakeRouter{stream: func(_ *llmmeshv1.ChatRequest, srv llmmeshv1.Router_ChatStreamServer) error {
		if err := srv.Send(delta(1, "Hi")); err != nil {
			return err
		}
		return status.Error(codes.Unavailable, "replica lost")
	}}
	r := post(t, serveGateway(t, router)+chatStreamPath, `{}`, nil)
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	if !bytes.HasSuffix(r.body, []byte("\n")) {
		t.Errorf("body %q does not end with a newline", r.body)
	}
	lines := strings.Split(strings.TrimSuffix(string(r.body), "\n"), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], `{"result":`) || !strings.HasPrefix(lines[1], `{"error":`) {
		t.Fatalf("lines %q: want a result line then an error line", lines)
	}
	var last struct {
		Error struct {
			GrpcCode int    `json:"grpc_code"`
			Message  string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(lines[1]), &last); err != nil || last.Error.GrpcCode != int(codes.Unavailable) || last.Error.Message != "replica lost" {
		t.Errorf("error line %q (%v)", lines[1], err)
	}
}

func TestAStreamRefusedBeforeItsFirstTokenIsAPlainHTTPErrorWithRetryAfter(t *testing.T) {
	limited, err := status.New(codes.ResourceExhausted, "rate limit exceeded").WithDetails(&errdetails.RetryInfo{RetryDelay: ptypes.DurationProto(1500 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		stream func(*llmmeshv1.ChatRequest, llmmeshv1.Router_ChatStreamServer) error
	}{
		{"trailers only", func(*llmmeshv1.ChatRequest, llmmeshv1.Router_ChatStreamServer) error { return limited.Err() }},
		{"after the response headers", func(_ *llmmeshv1.ChatRequest, srv llmmeshv1.Router_ChatStreamServer) error {
			if err := srv.SendHeader(metadata.Pairs("x-served-by", "router-1")); err != nil {
				return err
			}
			return limited.Err()
		}},
	} {
		r := post(t, serveGateway(t, &fakeRouter{stream: c.stream})+chatStreamPath, `{}`, nil)
		body := decodeError(t, r)
		if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") != "2" {
			t.Errorf("%s: got %d Retry-After %q; want 429 and 2", c.name, r.status, r.header.Get("Retry-After"))
		}
		if body.Code != int(codes.ResourceExhausted) || body.Message != "rate limit exceeded" || len(*body.Details) != 1 {
			t.Errorf("%s: body %s", c.name, r.body)
		}
		if r.header.Get("Transfer-Encoding") != "" || len(r.trailer) != 0 {
			t.Errorf("%s: streamed headers or trailers on a refusal: %v %v", c.name, r.header, r.trailer)
		}
	}
}

func TestAStreamStillFlowsWhole(t *testing.T) {
	router := &fakeRouter{stream: func(_ *llmmeshv1.ChatRequest, srv llmmeshv1.Router_ChatStreamServer) error {
		if err := srv.SendHeader(metadata.Pairs("x-served-by", "router-1")); err != nil {
			return err
		}
		for seq, text := range []string{"a", "b", "c"} {
			if err := srv.Send(delta(uint64(seq+1), text)); err != nil {
				return err
			}
		}
		return nil
	}}
	r := post(t, serveGateway(t, router)+chatStreamPath, `{}`, nil)
	lines := strings.SplitAfter(string(r.body), "\n")
	first := `{"result":{"request_id":"","seq":"1","delta":{"text":"a",`
	if r.status != http.StatusOK || len(lines) != 4 || lines[3] != "" || !strings.HasPrefix(lines[0], first) || r.header.Get("Grpc-Metadata-X-Served-By") != "router-1" {
		t.Fatalf("got %d %v %q", r.status, r.header, r.body)
	}
	empty := post(t, serveGateway(t, &fakeRouter{stream: func(*llmmeshv1.ChatRequest, llmmeshv1.Router_ChatStreamServer) error { return nil }})+chatStreamPath, `{}`, nil)
	if empty.status != http.StatusOK || len(empty.body) != 0 {
		t.Fatalf("an empty stream: %d %q", empty.status, empty.body)
	}
}
