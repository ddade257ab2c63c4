// Command llm-mesh-gateway serves the llm-mesh Router's annotated RPCs as REST +
// JSON (grpc-gateway), as a sidecar beside the router.
//
// Requests are translated by the handlers protoc-gen-grpc-gateway generates
// from protos/llmmesh/v1/router.proto; this file only adds what a public HTTP
// front needs: timeouts, a body limit, header hygiene, /healthz, the OpenAPI
// spec, and a graceful stop.
package main

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/textproto"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/golang/protobuf/jsonpb"
	"github.com/golang/protobuf/proto"
	"github.com/golang/protobuf/ptypes"
	"github.com/grpc-ecosystem/grpc-gateway/runtime"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	llmmeshv1 "llmmesh/gen/llmmeshv1"
)

// openAPISpec is the Swagger 2.0 document protoc-gen-swagger wrote from the
// same annotations, so the spec and the routes cannot drift apart.
//
//go:embed openapi.json
var openAPISpec []byte

// internalMetadataPrefix marks metadata only the router may set (the tenant,
// the user): a REST client must not be able to smuggle it in.
const internalMetadataPrefix = "x-llmmesh-"

type config struct {
	listen            string
	upstream          string
	upstreamCA        string
	healthService     string
	maxBodyBytes      int64
	readHeaderTimeout time.Duration
	readBodyTimeout   time.Duration
	idleTimeout       time.Duration
	healthTimeout     time.Duration
	shutdownGrace     time.Duration
}

func parseFlags() config {
	var c config
	flag.StringVar(&c.listen, "listen", envOr("LLMMESH_GATEWAY_LISTEN", "127.0.0.1:8080"), "HTTP listen address (port 0 picks a free one)")
	flag.StringVar(&c.upstream, "upstream", envOr("LLMMESH_GATEWAY_UPSTREAM", "127.0.0.1:50051"), "the router's gRPC address")
	flag.StringVar(&c.upstreamCA, "upstream-ca", envOr("LLMMESH_GATEWAY_UPSTREAM_CA", ""), "PEM CA bundle: dial the router over TLS (plaintext when empty)")
	flag.StringVar(&c.healthService, "health-service", "llmmesh.v1.Router", "gRPC health service name /healthz checks")
	flag.Int64Var(&c.maxBodyBytes, "max-body-bytes", 1<<20, "largest request body accepted; larger ones get 413")
	flag.DurationVar(&c.readHeaderTimeout, "read-header-timeout", 10*time.Second, "time allowed to send the request headers (slowloris guard)")
	flag.DurationVar(&c.readBodyTimeout, "read-body-timeout", 30*time.Second, "time allowed to send the request body once the headers are in (408 past it)")
	flag.DurationVar(&c.idleTimeout, "idle-timeout", 120*time.Second, "keep-alive connections idle longer are closed")
	flag.DurationVar(&c.healthTimeout, "health-timeout", 2*time.Second, "deadline of the router health check behind /healthz")
	flag.DurationVar(&c.shutdownGrace, "shutdown-grace", 30*time.Second, "on SIGTERM, time in-flight requests get to finish")
	flag.Parse()
	if c.maxBodyBytes <= 0 {
		log.Fatalf("--max-body-bytes must be positive, got %d", c.maxBodyBytes)
	}
	return c
}

func envOr(key, fallback string) string {
	if v, ok := os.LookupEnv(key); ok {
		return v
	}
	return fallback
}

func main() {
	log.SetFlags(log.LstdFlags | log.LUTC)
	cfg := parseFlags()

	conn, err := dialRouter(cfg)
	if err != nil {
		log.Fatalf("dial %s: %v", cfg.upstream, err)
	}
	defer conn.Close()
	handler, err := newHandler(cfg, conn)
	if err != nil {
		log.Fatalf("register routes: %v", err)
	}

	server := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: cfg.readHeaderTimeout,
		// The connection, for limitBody's read deadline (no ReadTimeout: net/http would
		// then bound a whole streamed answer's connection, not just the body's upload).
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, c)
		},
		IdleTimeout: cfg.idleTimeout,
		// No WriteTimeout: a streamed answer lasts as long as generation does;
		// deadlines come from the client's Grpc-Timeout instead.
	}
	listener, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		log.Fatalf("listen %s: %v", cfg.listen, err)
	}
	// Same line shape as the Python services, so launchers and tests can use port 0.
	fmt.Printf("llm-mesh gateway listening on %s (upstream %s)\n", listener.Addr(), cfg.upstream)

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()

	select {
	case err := <-served:
		log.Fatalf("serve: %v", err)
	case sig := <-stop:
		log.Printf("%s: draining for up to %s", sig, cfg.shutdownGrace)
	}
	// Shutdown closes the listener at once and waits for requests in flight,
	// streams included, to finish.
	ctx, cancel := context.WithTimeout(context.Background(), cfg.shutdownGrace)
	defer cancel()
	if err := server.Shutdown(ctx); err != nil {
		log.Printf("shutdown: %v", err)
	}
}

// dialRouter opens the connection every request shares. The dial does not
// block: the gateway may start before the router, and /healthz tells.
func dialRouter(cfg config) (*grpc.ClientConn, error) {
	creds := grpc.WithInsecure()
	if cfg.upstreamCA != "" {
		tlsCreds, err := credentials.NewClientTLSFromFile(cfg.upstreamCA, "")
		if err != nil {
			return nil, fmt.Errorf("--upstream-ca: %w", err)
		}
		creds = grpc.WithTransportCredentials(tlsCreds)
	}
	// Reconnect within 2 s of the router coming back: grpc's default back-off grows to 120 s,
	// and fail-fast calls do not cut it short, so /healthz and every call said 503 for up to
	// ~40 s after a router restart (the pod stayed unready as long).
	backoff := grpc.WithConnectParams(grpc.ConnectParams{
		Backoff:           grpcbackoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
		MinConnectTimeout: 2 * time.Second,
	})
	return grpc.Dial(cfg.upstream, creds, backoff)
}

// newHandler routes /healthz and /openapi.json here and every other path to
// the generated REST handlers, behind the body limit.
func newHandler(cfg config, conn *grpc.ClientConn) (http.Handler, error) {
	gateway := runtime.NewServeMux(
		runtime.WithMarshalerOption(runtime.MIMEWildcard, strictJSON{&runtime.JSONPb{OrigName: true, EmitDefaults: true}}),
		runtime.WithIncomingHeaderMatcher(incomingHeader),
		runtime.WithOutgoingHeaderMatcher(outgoingHeader),
	)
	// This grpc-gateway release takes its error writers as package variables.
	runtime.HTTPError = httpError
	runtime.OtherErrorHandler = routingError
	if err := llmmeshv1.RegisterRouterHandler(context.Background(), gateway, conn); err != nil {
		return nil, err
	}
	routes := http.NewServeMux()
	routes.HandleFunc("/healthz", healthz(healthpb.NewHealthClient(conn), cfg))
	routes.HandleFunc("/openapi.json", serveSpec)
	routes.Handle("/", limitBody(cfg.maxBodyBytes, cfg.readBodyTimeout, plainMethods(gateway)))
	return routes, nil
}

// plainMethods keeps a request's method and body what the client sent: this grpc-gateway
// release honours X-HTTP-Method-Override, and routes a form-encoded POST by path length
// through a Go map (so at random), which turned curl's empty form POST to /v1/tasks/{id} into
// a CancelTask one call in a few. Every body here is JSON.
func plainMethods(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Header.Del("X-HTTP-Method-Override")
		if strings.HasPrefix(strings.ToLower(r.Header.Get("Content-Type")), "application/x-www-form-urlencoded") {
			r.Header.Set("Content-Type", "application/json")
		}
		next.ServeHTTP(w, r)
	})
}

// connKey holds the request's net.Conn in its context (Server.ConnContext).
type connKey struct{}

// incomingHeader forwards `Grpc-Metadata-*` headers as metadata, except the
// router-internal keys. `Authorization` is forwarded by the runtime itself (as
// `authorization`); every other HTTP header stays HTTP.
func incomingHeader(key string) (string, bool) {
	key = textproto.CanonicalMIMEHeaderKey(key)
	if !strings.HasPrefix(key, runtime.MetadataHeaderPrefix) {
		return "", false
	}
	name := strings.ToLower(strings.TrimPrefix(key, runtime.MetadataHeaderPrefix))
	if name == "" || name == "authorization" || strings.HasPrefix(name, internalMetadataPrefix) {
		return "", false
	}
	return name, true
}

// strictJSON is the runtime's JSON marshaler with a decoder that refuses
// unknown fields: a misspelt "max_token" is a 400 naming it, not an option
// silently ignored (this grpc-gateway release always allows them).
type strictJSON struct{ *runtime.JSONPb }

func (strictJSON) NewDecoder(r io.Reader) runtime.Decoder {
	d := json.NewDecoder(r)
	return runtime.DecoderFunc(func(v interface{}) error {
		msg, ok := v.(proto.Message)
		if !ok {
			// A body bound to a scalar field keeps the runtime's rules.
			return runtime.DecoderWrapper{Decoder: d}.Decode(v)
		}
		if err := (&jsonpb.Unmarshaler{AllowUnknownFields: false}).UnmarshalNext(d, msg); err != nil {
			return err
		}
		// One JSON value per body: `{…} {"garbage": 1}` was taken, its second value ignored.
		if _, err := d.Token(); err != io.EOF {
			return status.Error(codes.InvalidArgument, "the request body holds more than one JSON value")
		}
		return nil
	})
}

// outgoingHeader passes the router's response metadata on as
// `Grpc-Metadata-*` headers, minus the transport's own (content-type, grpc-*),
// which mean nothing to an HTTP client.
func outgoingHeader(key string) (string, bool) {
	key = strings.ToLower(key)
	if key == "content-type" || strings.HasPrefix(key, "grpc-") {
		return "", false
	}
	return runtime.MetadataHeaderPrefix + key, true
}

// httpError is the runtime's default error reply (HTTP status from the gRPC
// code, JSON body with the message and details) plus `Retry-After` when the
// router said when to come back (RetryInfo on RESOURCE_EXHAUSTED).
func httpError(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
	if st, ok := status.FromError(err); ok {
		for _, detail := range st.Details() {
			info, ok := detail.(*errdetails.RetryInfo)
			if !ok || info.RetryDelay == nil {
				continue
			}
			if delay, derr := ptypes.Duration(info.RetryDelay); derr == nil {
				seconds := int64((delay + time.Second - 1) / time.Second)
				w.Header().Set("Retry-After", strconv.FormatInt(seconds, 10))
			}
		}
	}
	runtime.DefaultHTTPError(ctx, mux, m, w, r, err)
}

// routingError answers unknown paths (404) and wrong methods (405) in the same
// JSON shape as every other error, instead of the runtime's plain text.
func routingError(w http.ResponseWriter, _ *http.Request, msg string, httpStatus int) {
	code := int32(codes.InvalidArgument)
	switch httpStatus {
	case http.StatusNotFound:
		code = int32(codes.NotFound)
	case http.StatusMethodNotAllowed:
		code = int32(codes.Unimplemented)
	}
	writeJSONError(w, httpStatus, code, msg)
}

// limitBody reads at most limit bytes of the body before the gateway sees it:
// an oversized request gets 413 and never reaches the router. Buffering also
// lets net/http notice a client that hangs up mid-stream (it watches the
// connection once the body is drained), which cancels the upstream RPC.
func limitBody(limit int64, timeout time.Duration, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > limit {
			tooLarge(w, limit)
			return
		}
		// A body sent slowly is cut off as slow headers are: 100 uploads stalled one byte short
		// held 186 MB of a sidecar whose limit is 128 Mi, and never timed out.
		conn, _ := r.Context().Value(connKey{}).(net.Conn)
		if conn != nil && timeout > 0 {
			_ = conn.SetReadDeadline(time.Now().Add(timeout))
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
		var timedOut net.Error
		if errors.As(err, &timedOut) && timedOut.Timeout() {
			// The deadline stays: net/http's drain of the rest of the body then fails at once,
			// and the connection closes after the 408.
			w.Header().Set("Connection", "close")
			writeJSONError(w, http.StatusRequestTimeout, int32(codes.DeadlineExceeded), fmt.Sprintf("request body not received within %s", timeout))
			return
		}
		if conn != nil && timeout > 0 {
			_ = conn.SetReadDeadline(time.Time{})
		}
		if err != nil {
			writeJSONError(w, http.StatusBadRequest, int32(codes.InvalidArgument), fmt.Sprintf("reading request body: %v", err))
			return
		}
		if int64(len(body)) > limit {
			tooLarge(w, limit)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(w, r)
	})
}

func tooLarge(w http.ResponseWriter, limit int64) {
	// Closing the connection spares reading the rest of a body we refused.
	w.Header().Set("Connection", "close")
	writeJSONError(w, http.StatusRequestEntityTooLarge, int32(codes.InvalidArgument), fmt.Sprintf("request body larger than %d bytes", limit))
}

// writeJSONError answers in the runtime's error shape, so clients parse one format.
func writeJSONError(w http.ResponseWriter, httpStatus int, grpcCode int32, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(httpStatus)
	_ = json.NewEncoder(w).Encode(map[string]interface{}{"error": message, "message": message, "code": grpcCode})
}

func serveSpec(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		writeJSONError(w, http.StatusMethodNotAllowed, int32(codes.Unimplemented), "only GET")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(openAPISpec)
}

// healthz answers 200 only while the router's own gRPC health says SERVING,
// so an orchestrator restarts or unroutes the pair, not just the sidecar.
func healthz(client healthpb.HealthClient, cfg config) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), cfg.healthTimeout)
		defer cancel()
		resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{Service: cfg.healthService})
		state, code := "UNKNOWN", http.StatusServiceUnavailable
		detail := ""
		switch {
		case err != nil:
			detail = status.Convert(err).Message()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				detail = "router health check timed out"
			}
		default:
			state = resp.GetStatus().String()
			if resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
				code = http.StatusOK
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		body := map[string]string{"status": state, "upstream": cfg.upstream}
		if detail != "" {
			body["error"] = detail
		}
		_ = json.NewEncoder(w).Encode(body)
	}
}
